"""Devices and links the planner prices compute and communication with, and how efficiently a device really runs
(`Efficiency`): datasheet numbers, measured profiles and calibrations, each saying where it came from.

Device. Peak: dense BF16 tensor-core TFLOP/s (no sparsity). Memory: what the device has (GiB), not what an
allocator leaves free. `mem_gbps`: memory bandwidth (GB/s). Links, in GB/s per device and direction: `nvlink`
inside a node (NVLink/NVSwitch), `fabric` across nodes (one 400 Gb/s NIC per GPU = 50 GB/s). Sources: NVIDIA's
H100, H200, B200 and A100 datasheets. `--link nvlink=...,fabric=...` and `--gpu NAME:peak_tflops:memory_gib`
override them. `cpu` has no datasheet peak: one CPU core (one thread, gloo) is a device whose peak, memory
bandwidth and links are measured (`meshforge bench --profile-device`, then `meshforge plan --calibrate`).

Efficiency. The time model (planning/step.py) prices each matmul on a roofline with a size curve (the larger of
its FLOPs at `gemm` x peak and its bytes at `memory` x bandwidth, plus a fixed `gemm_overhead_s` per kernel), the
attention kernels at `attention` x peak (a curve over the sequence length where measured), elementwise work and the
optimizer at `memory` x bandwidth, and collectives at `comm` x link bandwidth plus `comm_latency_s` per call;
`compute_scale` is what a calibration on a measured run adds on top (measured compute / modelled compute).
Defaults per device are stated in `DEFAULT_EFFICIENCY` with their sources; `--mfu X` is the one-number model
(every matmul and attention FLOP at X of the peak, elementwise work free).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense bf16 (cpu: measured fp32 matmul rate of one core)
    memory_gib: float
    nvlink_gbps: float  # GB/s per device per direction inside a node
    fabric_gbps: float  # GB/s per device per direction across nodes
    mem_gbps: float = 3350.0  # memory bandwidth, GB/s

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


DEVICES: dict[str, Device] = {
    "a100": Device("a100", 312.0, 80, 300.0, 25.0, 2039.0),  # A100 SXM 80GB, NVLink 3, 200 Gb/s NIC, 2.0 TB/s HBM2e
    "h100": Device("h100", 989.0, 80, 450.0, 50.0, 3350.0),  # H100 SXM, NVLink 4, 400 Gb/s NIC, 3.35 TB/s HBM3
    "h200": Device("h200", 989.0, 141, 450.0, 50.0, 4800.0),  # H200 SXM: H100 compute, 141 GB HBM3e at 4.8 TB/s
    "b200": Device("b200", 2250.0, 180, 900.0, 50.0, 8000.0),  # B200 (HGX): NVLink 5, 8 TB/s HBM3e
}
CPU = "cpu"  # measured, never assumed: `meshforge bench --profile-device` then `meshforge plan --calibrate`


@dataclass(frozen=True)
class Efficiency:
    """How close to its datasheet a device runs each kind of work; `source` says where the numbers came from."""

    gemm: float  # fraction of the peak large matmuls reach
    gemm_overhead_s: float  # fixed time per matmul kernel (launch, fill and tail: small matmuls are latency bound)
    attention: tuple[tuple[int, float], ...]  # (sequence length, fraction of the peak) points, log-interpolated
    memory: float  # fraction of the memory bandwidth elementwise kernels and the optimizer reach
    comm: float  # fraction of the link bandwidth collectives reach
    comm_latency_s: float  # per collective call
    overlap: bool  # data-parallel collectives run beside compute (a GPU's copy engines; a CPU core does both in turn)
    fp8_gemm_speedup: float  # float8 matmuls (training.fp8) over bf16 ones, the casts included
    compute_scale: float = 1.0  # calibrated: measured compute time / modelled compute time
    # calibrated: the framework's host time per block call (one block's forward or backward, the embedding's or
    # the head's, for one micro batch: hooks, Python, the pipeline schedule); a GPU runs ahead of its host, so
    # there it adds only where the host is slower than the device; a CPU core does both in turn
    host_s_per_call: float = 0.0
    source: str = "defaults"
    fit: dict = field(default_factory=dict, compare=False)  # what a calibration measured and predicted

    def attention_fraction(self, seq_len: int) -> float:
        """The attention kernels' fraction of the peak at this sequence length (log-linear between measured
        points, the nearest end outside them)."""
        pts = self.attention
        if len(pts) == 1 or seq_len <= pts[0][0]:
            return pts[0][1]
        if seq_len >= pts[-1][0]:
            return pts[-1][1]
        for (s0, f0), (s1, f1) in zip(pts, pts[1:]):
            if s0 <= seq_len <= s1:
                w = math.log(seq_len / s0) / math.log(s1 / s0)
                return f0 + w * (f1 - f0)
        return pts[-1][1]

    def describe(self) -> str:
        """One line for every plan output: which efficiencies priced the step time and where they came from."""
        att = self.attention
        att_s = (f"{att[0][1]:.2f}" if len(att) == 1 else
                 f"{att[0][1]:.3f}@{att[0][0]}..{att[-1][1]:.3f}@{att[-1][0]} tokens")
        return (f"matmul {self.gemm:.2f} of peak (+{self.gemm_overhead_s * 1e6:.1f} us/kernel), attention {att_s}, "
                f"memory {self.memory:.2f}, comm {self.comm:.2f} (+{self.comm_latency_s * 1e6:.0f} us/call"
                f"{'' if self.overlap else ', not overlapped'}), compute scale {self.compute_scale:.3f}, host "
                f"{self.host_s_per_call * 1e3:.2f} ms/framework call, "
                f"fp8 matmuls x{self.fp8_gemm_speedup:g} -- {self.source}")

    def to_dict(self) -> dict:
        return {"gemm": self.gemm, "gemm_overhead_s": self.gemm_overhead_s,
                "attention": [list(p) for p in self.attention], "memory": self.memory, "comm": self.comm,
                "comm_latency_s": self.comm_latency_s, "overlap": self.overlap,
                "fp8_gemm_speedup": self.fp8_gemm_speedup, "compute_scale": self.compute_scale,
                "host_s_per_call": self.host_s_per_call, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> Efficiency:
        return cls(gemm=float(d["gemm"]), gemm_overhead_s=float(d["gemm_overhead_s"]),
                   attention=tuple((int(s), float(f)) for s, f in d["attention"]), memory=float(d["memory"]),
                   comm=float(d["comm"]), comm_latency_s=float(d["comm_latency_s"]), overlap=bool(d["overlap"]),
                   fp8_gemm_speedup=float(d["fp8_gemm_speedup"]), compute_scale=float(d.get("compute_scale", 1.0)),
                   host_s_per_call=float(d.get("host_s_per_call", 0.0)), source=str(d.get("source", "?")))


# Datasheet-side defaults, each number with its source (nothing here is calibrated on a meshforge run):
#  gemm 0.80: large bf16 matmuls on this workplace's H200 ran at about 790 of 989 TFLOP/s (the device notes);
#    assumed alike on A100/H100/B200. gemm_overhead_s 4 us: a kernel's launch, fill and tail (assumed).
#  attention: FlashAttention-2 (torch's SDPA flash backend) reaches 50-73% of an A100's peak (FA2 paper,
#    arXiv 2307.08691) and about 35% of an H100's (FA3 paper, arXiv 2407.08608); 0.60 and 0.35, B200 as H100.
#  memory 0.80 of the datasheet bandwidth for streaming elementwise kernels (assumed).
#  comm 0.80 of the link for large NCCL ring collectives, 20 us per call (assumed; nccl-tests' busbw is ~80%).
#  fp8 1.8x: torchao float8 reports 1.5x end to end at 405B / 512 H100 (docs.pytorch.org/ao, pretraining), which
#    with ~75% of the step in converted matmuls means 1.8x on those matmuls, casts included.
_GPU = dict(gemm=0.80, gemm_overhead_s=4e-6, memory=0.80, comm=0.80, comm_latency_s=20e-6, overlap=True,
            fp8_gemm_speedup=1.8)
DEFAULT_EFFICIENCY: dict[str, Efficiency] = {
    "a100": Efficiency(attention=((1, 0.60),), source="a100 datasheet defaults (planning/hardware.py)",
                       **{**_GPU, "fp8_gemm_speedup": 1.0}),  # no float8 tensor cores
    "h100": Efficiency(attention=((1, 0.35),), source="h100 datasheet defaults (planning/hardware.py)", **_GPU),
    "h200": Efficiency(attention=((1, 0.35),), source="h200 datasheet defaults (planning/hardware.py)", **_GPU),
    "b200": Efficiency(attention=((1, 0.35),), source="b200 datasheet defaults (planning/hardware.py)", **_GPU),
}


def default_efficiency(dev: Device) -> Efficiency:
    """The stated defaults for a known device; a custom `NAME:TFLOPS:GIB` device is priced as an h100."""
    eff = DEFAULT_EFFICIENCY.get(dev.name.lower())
    if eff is None:
        eff = replace(DEFAULT_EFFICIENCY["h100"], source=f"{dev.name}: h100 datasheet defaults (a custom device)")
    return eff


def flat_efficiency(mfu: float) -> Efficiency:
    """`--mfu X`: the one-number model (every matmul and attention FLOP at X of the peak; elementwise work,
    kernel and collective latencies free; links at their datasheet bandwidth)."""
    return Efficiency(gemm=mfu, gemm_overhead_s=0.0, attention=((1, mfu),), memory=math.inf, comm=1.0,
                      comm_latency_s=0.0, overlap=True, fp8_gemm_speedup=1.0,
                      source=f"--mfu {mfu:g} (one number for all compute, as given)")


def device_from_arg(spec: str) -> Device:
    """`h100`, or a custom device `NAME:PEAK_TFLOPS:MEMORY_GIB[:MEMORY_GBPS]` (memory bandwidth and links as an
    h100's unless given / `--link` says)."""
    key = spec.lower()
    if key in DEVICES:
        return DEVICES[key]
    if key == CPU:
        raise ValueError("--gpu cpu: a CPU core's peak is measured, not assumed: run `meshforge bench CONFIG "
                         "--profile-device`, calibrate with `meshforge plan --calibrate OUTPUT_DIR` and plan with "
                         "--efficiency OUTPUT_DIR/efficiency.json")
    parts = spec.split(":")
    h = DEVICES["h100"]
    if len(parts) in (3, 4):
        try:
            nums = [float(x) for x in parts[1:]] + ([h.mem_gbps] if len(parts) == 3 else [])
        except ValueError:
            nums = [-1.0]
        if all(0 < x < math.inf for x in nums):
            return Device(parts[0], nums[0], nums[1], h.nvlink_gbps, h.fabric_gbps, nums[2])
    raise ValueError(f"--gpu {spec!r} is not a known device ({', '.join(DEVICES)}) nor "
                     "NAME:PEAK_TFLOPS:MEMORY_GIB[:MEMORY_GBPS] with positive numbers")


def with_links(dev: Device, spec: str | None) -> Device:
    """Apply `nvlink=GBPS,fabric=GBPS` (either or both) to a device."""
    if not spec:
        return dev
    out = dev
    for item in spec.split(","):
        key, _, val = item.partition("=")
        try:
            gbps = float(val)
        except ValueError:
            gbps = -1.0
        if key.strip() not in ("nvlink", "fabric") or not 0 < gbps < math.inf:
            raise ValueError(f"--link {spec!r}: write nvlink=GBPS,fabric=GBPS with positive numbers")
        out = replace(out, **{f"{key.strip()}_gbps": gbps})
    return out
