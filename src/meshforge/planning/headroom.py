"""What a GPU needs beyond the tensors the plan counts: the margins behind the verdict "fits" (`Headroom`).

The plan's peak is the bytes live tensors hold at the worst moment of a step (what the scale trace measures).
A device runs out of memory earlier than that sum says, for reasons outside the tensors:
  fragmentation  the caching allocator's reserved-but-unused memory: it rounds requests up (512 B, 2 MiB
                 segments for large blocks) and cannot always reuse a freed block for a larger request.
                 Default 10% of the peak. Source: PyTorch's CUDA-semantics notes on the caching allocator
                 (`PYTORCH_CUDA_ALLOC_CONF`, `expandable_segments` exists to cut exactly this) and the ratio
                 `reserved_bytes.all.peak / allocated_bytes.all.peak` of `torch.cuda.memory_stats()`, which is
                 how to set it for your own run (`--headroom fragmentation=0.05`).
  context_gib    memory the CUDA context, kernel images and library workspaces (cuBLAS/cuBLASLt, cuDNN) take
                 outside torch's allocator. Default 1 GiB: an H100 process holds 0.5-0.6 GiB for its context
                 with CUDA's lazy module loading (the default since CUDA 11.7), plus cuBLASLt workspaces
                 (`CUBLAS_WORKSPACE_CONFIG`, 32 MiB per handle on Hopper) and NCCL's own kernels.
  nccl_mib       NCCL's buffers per communicator this rank belongs to (a mesh axis group of more than one
                 rank): `NCCL_BUFFSIZE` (4 MiB by default) per channel and direction, 32 channels on an NVLink
                 node: 256 MiB. Default 256 MiB per communicator (NCCL's environment-variable documentation;
                 more with NVLink SHARP, `NCCL_NVLS_ENABLE`).
  compile_gib    torch.compile's workspaces (inductor's generated kernels, autotuning buffers) when blocks are
                 compiled. Default 0.5 GiB.
  fp8_gib        FP8 matmuls' cuBLASLt workspace and scaling buffers when training.fp8 is on. Default 0.25 GiB.
Fits means peak x (1 + fragmentation) + the rest <= the device's memory. `--headroom none` plans the tensors
alone (the old verdict); `--headroom KEY=VALUE,...` changes single margins.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Headroom:
    fragmentation: float = 0.10
    context_gib: float = 1.0
    nccl_mib: float = 256.0
    compile_gib: float = 0.5
    fp8_gib: float = 0.25

    def parts(self, peak: int, communicators: int, compiled: bool, fp8: bool) -> dict[str, int]:
        """{margin: bytes} on top of a peak of `peak` tensor bytes, for a rank in `communicators` groups."""
        return {"fragmentation": int(peak * self.fragmentation), "context": int(self.context_gib * GIB),
                "nccl": int(communicators * self.nccl_mib * MIB),
                "compile": int(self.compile_gib * GIB) if compiled else 0,
                "fp8": int(self.fp8_gib * GIB) if fp8 else 0}


NONE = Headroom(0.0, 0.0, 0.0, 0.0, 0.0)


def headroom_from_arg(spec: str | None) -> Headroom:
    """`--headroom`: None (the defaults), `none` (no margin) or KEY=VALUE,... over the defaults; ValueError
    (one line) on anything else."""
    if not spec:
        return Headroom()
    if spec.strip().lower() == "none":
        return NONE
    names = [f.name for f in fields(Headroom)]
    out = Headroom()
    for item in spec.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        try:
            number = float(val)
        except ValueError:
            number = -1.0
        if key not in names or number < 0 or (key == "fragmentation" and number >= 1):
            raise ValueError(f"--headroom {spec!r}: write none or KEY=VALUE,... with KEY one of {', '.join(names)} "
                             "and VALUE >= 0 (fragmentation a fraction below 1)")
        out = replace(out, **{key: number})
    return out


def communicators(layout) -> int:
    """The communicators (process groups of more than one rank) a rank of `layout` belongs to: one per distinct
    group of its mesh axes, the pipeline's neighbour pairs counted as one."""
    from meshforge.planning.layout import MeshAxis

    seen = set()
    for axis in ("tp", "cp", "pp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "ep", "ep_shard"):
        if axis.startswith("ep") and layout.ep == 1:
            continue
        n = layout.size(MeshAxis.parse(axis))
        if n > 1:
            seen.add(_dims(axis, layout))
    return len(seen)


def _dims(axis: str, layout) -> tuple:
    """The root dimensions (of size > 1) a group spans: axes spanning the same ones share a communicator."""
    from meshforge.planning.layout import FLAT_DIMS, MeshAxis

    if axis in ("ep", "ep_shard"):
        return (axis,)
    dims = FLAT_DIMS.get(MeshAxis.parse(axis), (MeshAxis.parse(axis),))
    return tuple(d for d in dims if layout.size(d) > 1)
