"""Step time of megatron_fsdp (optim_grads_params) against fsdp2, as a ratio, at N ranks.

Both models are built in the same processes and their steps alternate (fsdp2, megatron_fsdp, fsdp2, ...),
so load on a shared machine hits both alike; the median of the timed steps is reported. One step = forward and
backward over this rank's micro-batches, gradient sync, clipping, AdamW step, post-step (megatron_fsdp copies
main -> compute shard). On CPU: gloo, fp32. On a GPU (`--device cuda`): NCCL, megatron_fsdp with bf16 compute
parameters and fp32 main parameters/reduction, fsdp2 with its CUDA default (bf16 params, fp32 reduce); at world
size 1 fsdp2 leaves the model unwrapped and runs it under bf16 autocast.

Both runs are built with `Trainer.build` and stepped with `Trainer.train_step`, the training loop's own step.

Usage: python benchmarks/megatron_vs_fsdp2_step_time.py [--nproc 2 4] [--presets tiny small] [--steps 6]
       [--device cpu|cuda] [--json out.json]   (one `meshforge.launch` per N)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SEQ = {"tiny": 32, "small": 128}


def _build(strategy: list[str], preset: str, info, device: str):
    from meshforge.config import load_config
    from meshforge.testing.parity import base_overrides
    from meshforge.training.trainer import Trainer

    ov = base_overrides(10) + [f"model.preset={preset}", f"training.seq_len={SEQ.get(preset, 128)}",
                               f"training.device={device}"] + strategy
    if device == "cuda":
        ov.append("training.precision=bf16")
    return Trainer.build(load_config(None, ov, world_size=info.world_size), info)


def measure(spec: dict) -> dict:
    """Launch target: both strategies in these processes, their steps alternating; rank 0's medians."""
    import torch
    import torch.distributed as dist

    from meshforge.distributed.env import destroy, init_distributed

    info = init_distributed(spec["device"], timeout_minutes=10)
    sync = (lambda: torch.cuda.synchronize()) if info.device.type == "cuda" else (lambda: None)
    out = {}
    for preset in spec["presets"]:
        runs = {"fsdp2": ["distributed.strategy=fsdp2"],
                "megatron_fsdp": ["distributed.strategy=megatron_fsdp",
                                  "distributed.data_parallel_sharding_strategy=optim_grads_params"]}
        built = {k: _build(v, preset, info, spec["device"]) for k, v in runs.items()}
        t = built["fsdp2"].cfg.training
        batch = built["fsdp2"].loader.next_batch()  # the same batch for both, every step
        times = {k: [] for k in runs}
        for i in range(spec["warmup"] + spec["steps"]):
            for k, trainer in built.items():
                if dist.is_initialized():
                    dist.barrier()
                sync()
                t0 = time.perf_counter()
                trainer.train_step(batch=batch)
                sync()
                if dist.is_initialized():
                    dist.barrier()
                if i >= spec["warmup"]:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[preset] = {"fsdp2_ms": med["fsdp2"] * 1e3, "megatron_fsdp_ms": med["megatron_fsdp"] * 1e3,
                       "ratio": med["megatron_fsdp"] / med["fsdp2"], "steps": spec["steps"],
                       "tokens_per_step": t.global_batch_size * t.seq_len}
        del built
    destroy()
    return out


def run(nproc: int, presets: list[str], steps: int = 6, warmup: int = 2, device: str = "cpu",
        timeout: float = 1800) -> dict:
    from meshforge.launch import launch

    spec = {"presets": presets, "steps": steps, "warmup": warmup, "device": device}
    return launch(f"{Path(__file__).resolve()}:measure", spec, nproc, timeout=timeout).check().value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {}
    print(f"{'N':>3s} {'preset':8s} {'fsdp2 ms':>10s} {'megatron_fsdp ms':>17s} {'ratio mf/fsdp2':>15s}")
    for n in args.nproc:
        r = run(n, args.presets, args.steps, args.warmup, args.device)
        results[n] = r
        for preset, v in r.items():
            print(f"{n:3d} {preset:8s} {v['fsdp2_ms']:10.1f} {v['megatron_fsdp_ms']:17.1f} {v['ratio']:15.2f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
