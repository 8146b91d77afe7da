"""Collectives of a traced step per (mesh axis, kind), in the bench's full-buffer bytes.

`CommRecorder` records what the bench's `CommCounter` counts (every collective reaches the dispatcher as a
`c10d::*` or `_c10d_functional*::*` op, DTensor's own included; `StepMemory`'s dispatch hands it each op) and
also asks which process group each op runs on (torch's `fake_collectives.CollectiveOp.get_process_group`) and
names it by the mesh axis whose group of this rank has the same ranks (`axis_names`). Events are kept in order
with the phase they fall in (set by the tracer: before the first micro batch, micro batch i, after the last), so
a folded step can be scaled.
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops

from meshforge.bench.measure import collective_bytes
from meshforge.planning.layout import Layout, MeshAxis

# the name a group of ranks gets when several axes have the same ranks (cp of size 1 makes dp_shard_cp = dp_shard)
AXIS_ORDER = ("tp", "cp", "pp", "ep", "dp_shard", "dp_replicate", "ep_shard", "dp_shard_cp", "dp", "dp_cp")
_KINDS = (("allgather", "all_gather"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter"),
          ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("alltoall", "all_to_all"),
          ("all_to_all", "all_to_all"), ("send", "send_recv"), ("recv", "send_recv"), ("broadcast", "broadcast"),
          ("p2p", "send_recv"))


def kind_of(op: str) -> str:
    """The plan's collective kind of a c10d op name."""
    name = op.split("::", 1)[-1]
    for key, kind in _KINDS:
        if key in name:
            return kind
    return name


def axis_names(layout: Layout, rank: int) -> dict[frozenset, str]:
    """{ranks of one of this rank's groups: the axis name}, the first of AXIS_ORDER for groups several axes share
    (the whole world is `world` unless an axis spans it)."""
    out: dict[frozenset, str] = {}
    for name in AXIS_ORDER:
        if name.startswith("ep") and layout.ep == 1:
            continue
        for g in layout.groups(MeshAxis.parse(name)):
            if rank in g:
                out.setdefault(frozenset(g), name)
                break
    out.setdefault(frozenset(range(layout.world_size)), "world")
    return out


def canonical(comm: dict[tuple[str, str], int], layout: Layout, rank: int) -> dict[tuple[str, str], int]:
    """A plan's {(axis, kind): bytes} under the names `axis_names` gives the same groups of ranks."""
    names = axis_names(layout, rank)
    out: dict[tuple[str, str], int] = defaultdict(int)
    for (axis, kind), n in comm.items():
        group = next((g for g in layout.groups(MeshAxis.parse(axis)) if rank in g), [rank]) \
            if axis in MeshAxis.__members__.values() else [rank]
        out[(names.get(frozenset(group), axis), kind)] += n
    return dict(out)


class CommRecorder:
    """Records (phase, axis, kind, bytes) of every collective `StepMemory` sees (one dispatch mode for both:
    each mode on the stack costs every op of the step)."""

    def __init__(self, layout: Layout, rank: int):
        self.names = axis_names(layout, rank)
        self.events: list[tuple[str, str, str, int]] = []
        self.phase = "pre"
        self._ranks: dict[int, str] = {}

    def _axis(self, func, args) -> str:
        pg = CollectiveOp.get_process_group(func, args)
        key = id(pg)
        if key not in self._ranks:
            ranks = frozenset(dist.get_process_group_ranks(pg))
            self._ranks[key] = self.names.get(ranks, f"group{sorted(ranks)[:4]}")
        return self._ranks[key]

    def record(self, func, args, kwargs) -> None:
        if func not in collective_ops:  # (most ops: asked first, before the schema)
            return
        name = func._schema.name
        if name.split("::", 1)[1] not in ("wait_tensor", "barrier", "monitored_barrier_"):
            n = collective_bytes(name, args, kwargs)
            self.events.append((self.phase, self._axis(func, args), kind_of(name), n))

    def totals(self, scale: dict[str, float] | None = None) -> dict[tuple[str, str], int]:
        """{(axis, kind): bytes}, each phase's events counted `scale[phase]` times (default once)."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        for phase, axis, kind, n in self.events:
            out[(axis, kind)] += n * (scale or {}).get(phase, 1)
        return {k: int(round(v)) for k, v in out.items() if v}
