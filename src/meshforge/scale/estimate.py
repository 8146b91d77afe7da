"""What tracing a rank will cost, before it starts (torch-free): the trace refuses what would exceed its limits.

The cost of a trace is the Python work of dispatching every op of the step on fake tensors (about 0.4 ms of CPU
per op, whatever the tensors' sizes) and of building the rank's meshes (linear in the world size). So it grows
with the blocks this rank runs times the micro batches it runs them for (a folded step runs 3, a pipeline step
all of its schedule's), more with tensor parallelism (DTensor's sharding propagation on every op) and with
activation checkpointing (the forward again in backward). Coefficients: CPU seconds measured on the
development machine (2 cores, torch 2.13; `benchmarks/scale_trace.py` prints the measured cost beside this
estimate for every example); wall time is longer when the machine is shared.
Memory: fake tensors hold no data, so the process needs about 0.4 GB (torch and the model's objects) plus a
little per block and per mesh group.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_MB_S = 0.15  # CPU seconds per block and micro batch (forward, backward, FSDP hooks, memory tracking)
TP_FACTOR = 1.3  # tensor parallelism: DTensor's per-op sharding propagation
AC_FACTOR = {None: 1.0, "selective": 1.1, "full": 1.35}  # the forward again in backward
MOE_FACTOR = 2.0  # routing, dispatch and the expert computation of every MoE block
START_S = 4.0  # import torch and meshforge, build and materialise the rank, one warm-up update
MESH_S_PER_RANK = 6e-5  # building the device meshes' process groups (1 s at 16,384 ranks)
BASE_BYTES = 450 * 2**20
BYTES_PER_BLOCK = 4 * 2**20
BYTES_PER_RANK = 2 * 2**10  # the process groups' bookkeeping
FOLDED = 3  # micro batches a folded (non-pipeline) step runs


@dataclass(frozen=True)
class TraceEstimate:
    cpu_s: float
    rss_bytes: int
    blocks: int  # blocks this rank runs
    microbatches: int  # micro batches the trace runs them for


def estimate(cfg, world_size: int, rank: int) -> TraceEstimate:
    """The estimated CPU seconds and peak RSS of tracing rank `rank` of `cfg` on `world_size` ranks."""
    from meshforge.models import resolve_model_args
    from meshforge.planning.layout import Layout, MeshAxis
    from meshforge.planning.state import pipeline_plan_of

    d, t = cfg.distributed, cfg.training
    layout = Layout.from_sizes(world_size, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size, dp=d.dp_size,
                               dp_replicate=d.dp_replicate_size)
    args = resolve_model_args(cfg.model)
    if layout.pp > 1:
        pplan = pipeline_plan_of(cfg, layout, args.n_layers)
        blocks = sum(len(pplan.stage_layers[s]) for s in pplan.rank_stages(layout.coords(rank)[MeshAxis.PP]))
        micro = pplan.n_microbatches
    else:
        blocks = args.n_layers
        micro = min(FOLDED, t.global_batch_size // layout.dp // t.micro_batch_size)
    per = BLOCK_MB_S * (TP_FACTOR if layout.tp > 1 else 1.0) * AC_FACTOR.get(d.ac_mode, 1.0)
    per *= MOE_FACTOR if args.is_moe else 1.0
    cpu_s = START_S + MESH_S_PER_RANK * world_size + per * blocks * micro
    rss = BASE_BYTES + BYTES_PER_BLOCK * blocks + BYTES_PER_RANK * world_size
    return TraceEstimate(cpu_s, int(rss), blocks, micro)
