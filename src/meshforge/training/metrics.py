"""Throughput accounting: tokens/s, TFLOP/s, MFU against a device peak table, and memory.

MFU is reported only where the peak is known (a table of data-center GPUs, or
`logging.peak_tflops`); on CPU it is null rather than an invented number.
"""

from __future__ import annotations

import torch

# dense bf16 tensor-core peak TFLOP/s (no sparsity), per device
PEAK_TFLOPS_BF16 = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0}


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_TFLOPS_BF16, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS_BF16[key]
    return None


def max_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def throughput(tokens: int, seconds: float, flops_per_token: float, world_size: int,
               peak_tflops: float | None) -> dict:
    """Per-device figures: tokens/s and TFLOP/s per device, MFU as a fraction of the device peak."""
    tps = tokens / max(seconds, 1e-9)
    tflops = tps * flops_per_token / 1e12 / world_size
    return {"tokens_per_s": tps, "tokens_per_s_per_device": tps / world_size, "tflops": tflops,
            "mfu": (tflops / peak_tflops) if peak_tflops else None}
