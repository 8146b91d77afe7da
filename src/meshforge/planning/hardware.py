"""Devices and links the planner prices compute and communication with (datasheet numbers, overridable).

Peak: dense BF16 tensor-core TFLOP/s (no sparsity). Memory: what the device has (GiB), not what an allocator
leaves free. Links, in GB/s per device and direction: `nvlink` inside a node (NVLink/NVSwitch),
`fabric` across nodes (one 400 Gb/s NIC per GPU = 50 GB/s). Sources: NVIDIA's H100, H200, B200 and A100
datasheets. `--link nvlink=...,fabric=...` and `--gpu NAME:peak_tflops:memory_gib` override them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense bf16
    memory_gib: float
    nvlink_gbps: float  # GB/s per device per direction inside a node
    fabric_gbps: float  # GB/s per device per direction across nodes

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


DEVICES: dict[str, Device] = {
    "a100": Device("a100", 312.0, 80, 300.0, 25.0),  # A100 SXM 80GB, NVLink 3 600 GB/s bidirectional, 200 Gb/s NIC
    "h100": Device("h100", 989.0, 80, 450.0, 50.0),  # H100 SXM, NVLink 4 900 GB/s bidirectional, 400 Gb/s NIC
    "h200": Device("h200", 989.0, 141, 450.0, 50.0),  # H200 SXM: H100 compute, 141 GB HBM3e
    "b200": Device("b200", 2250.0, 180, 900.0, 50.0),  # B200 (HGX): NVLink 5 1.8 TB/s bidirectional
}


def device_from_arg(spec: str) -> Device:
    """`h100`, or a custom device `NAME:PEAK_TFLOPS:MEMORY_GIB` (links as an h100 unless `--link` says)."""
    key = spec.lower()
    if key in DEVICES:
        return DEVICES[key]
    parts = spec.split(":")
    if len(parts) == 3:
        try:
            return Device(parts[0], float(parts[1]), float(parts[2]), DEVICES["h100"].nvlink_gbps,
                          DEVICES["h100"].fabric_gbps)
        except ValueError:
            pass
    raise ValueError(f"--gpu {spec!r} is not a known device ({', '.join(DEVICES)}) nor NAME:PEAK_TFLOPS:MEMORY_GIB")


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
        if key.strip() not in ("nvlink", "fabric") or gbps <= 0:
            raise ValueError(f"--link {spec!r}: write nvlink=GBPS,fabric=GBPS with positive numbers")
        out = replace(out, **{f"{key.strip()}_gbps": gbps})
    return out
