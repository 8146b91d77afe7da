"""The rank layout of a parallel configuration, computed without any process group.

This is the arithmetic half of `MeshContext`: sizes, the inferred dp size, and
which global ranks share each axis. `MeshContext` builds its DeviceMeshes from
exactly this layout, so `meshforge validate --world-size N` prints what a real
run will use. Root dims are `(pp, dp_replicate, dp_shard, cp, tp)`, row-major,
so TP groups are contiguous ranks (inside one node).
"""

from __future__ import annotations

import functools

import itertools
from dataclasses import dataclass
from enum import StrEnum

from meshforge.errors import LayoutError


class MeshAxis(StrEnum):
    PP = "pp"
    DP = "dp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    DP_SHARD_CP = "dp_shard_cp"
    DP_CP = "dp_cp"
    CP = "cp"
    TP = "tp"
    EP = "ep"
    EP_SHARD = "ep_shard"

    @classmethod
    def parse(cls, name: str | MeshAxis) -> MeshAxis:
        try:
            return cls(name)
        except ValueError:
            raise KeyError(f"unknown mesh axis {name!r}; axes are {', '.join(a.value for a in cls)}") from None


ROOT_DIMS = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP, MeshAxis.TP)
# flattened views: name -> the root dims it spans
FLAT_DIMS = {
    MeshAxis.DP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD),
    MeshAxis.DP_SHARD_CP: (MeshAxis.DP_SHARD, MeshAxis.CP),
    MeshAxis.DP_CP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP),
}


def inferred_dp(world_size: int, tp: int, pp: int, cp: int) -> int | None:
    """dp = world / (tp * pp * cp), or None when the product does not divide the world size."""
    denom = tp * pp * cp
    return world_size // denom if world_size % denom == 0 else None


@dataclass(frozen=True)
class Layout:
    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    @classmethod
    def from_sizes(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                   dp: int | None = None, dp_replicate: int | None = None) -> Layout:
        """Infer dp = world / (tp*pp*cp); raise LayoutError with the numbers when it does not fit."""
        inferred = inferred_dp(world_size, tp, pp, cp)
        if inferred is None:
            raise LayoutError(f"world size {world_size} is not divisible by tp_size*pp_size*cp_size = "
                              f"{tp}*{pp}*{cp} = {tp * pp * cp}")
        if dp is not None and dp != inferred:
            raise LayoutError(f"dp_size={dp} disagrees with world_size/(tp_size*pp_size*cp_size) = "
                              f"{world_size}/{tp * pp * cp} = {inferred}")
        rep = dp_replicate or 1
        if inferred % rep:
            raise LayoutError(f"dp_replicate_size={rep} does not divide dp_size={inferred}")
        return cls(world_size, pp, rep, inferred // rep, cp, tp, ep)

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def named_shape(self) -> dict[str, int]:
        """{root axis: size}, in mesh order."""
        return {a.value: n for a, n in zip(ROOT_DIMS, self.shape)}

    def size(self, axis: str | MeshAxis) -> int:
        return _size(self, MeshAxis.parse(axis))

    def _size(self, axis: MeshAxis) -> int:
        if axis in FLAT_DIMS:
            n = 1
            for d in FLAT_DIMS[axis]:
                n *= self.size(d)
            return n
        if axis is MeshAxis.EP:
            return self.ep
        if axis is MeshAxis.EP_SHARD:
            return self.size(MeshAxis.DP_CP) // self.ep
        return self.shape[ROOT_DIMS.index(axis)]

    # ------------------------------------------------------------------ ranks
    def coords(self, rank: int) -> dict[MeshAxis, int]:
        """Coordinates of a global rank on every axis (flattened axes row-major over their dims)."""
        return dict(_coords(self, rank))

    def _coords(self, rank: int) -> dict[MeshAxis, int]:
        c, rest = {}, rank
        for axis, n in zip(reversed(ROOT_DIMS), reversed(self.shape)):
            c[axis] = rest % n
            rest //= n
        for flat, dims in FLAT_DIMS.items():
            idx = 0
            for d in dims:
                idx = idx * self.size(d) + c[d]
            c[flat] = idx
        c[MeshAxis.EP] = c[MeshAxis.DP_CP] % self.ep
        c[MeshAxis.EP_SHARD] = c[MeshAxis.DP_CP] // self.ep
        return c

    def rank_of(self, coords: dict[MeshAxis, int]) -> int:
        r = 0
        for axis, n in zip(ROOT_DIMS, self.shape):
            r = r * n + coords[axis]
        return r

    def groups(self, axis: str | MeshAxis) -> list[list[int]]:
        """The process groups of one axis: lists of global ranks that differ only along it."""
        axis = MeshAxis.parse(axis)
        if axis in (MeshAxis.EP, MeshAxis.EP_SHARD):
            out = []
            for g in self.groups(MeshAxis.DP_CP):
                if axis is MeshAxis.EP:
                    out += [g[i:i + self.ep] for i in range(0, len(g), self.ep)]
                else:
                    out += [g[i::self.ep] for i in range(self.ep)]
            return out
        dims = FLAT_DIMS.get(axis, (axis,))
        others = [d for d in ROOT_DIMS if d not in dims]
        out = []
        for fixed in itertools.product(*(range(self.size(d)) for d in others)):
            base = dict(zip(others, fixed))
            group = []
            for varying in itertools.product(*(range(self.size(d)) for d in dims)):
                group.append(self.rank_of({**base, **dict(zip(dims, varying))}))
            out.append(group)
        return out

    def nodes_spanned(self, gpus_per_node: int) -> dict[str, int]:
        """{axis: the most nodes one of its groups spans}, ranks filling nodes in order (rank // gpus_per_node:
        what torchrun and srun's block distribution do). >1 means that axis's collectives cross the network."""
        return {axis: max(len({r // gpus_per_node for r in g}) for g in self.groups(axis))
                for axis, _, _ in self.table()}

    def table(self) -> list[tuple[str, int, str]]:
        """(axis, size, groups) rows for the validate command."""
        rows = []
        for axis in (*ROOT_DIMS, *FLAT_DIMS, MeshAxis.EP_SHARD, MeshAxis.EP):
            if axis in (MeshAxis.EP, MeshAxis.EP_SHARD) and self.ep == 1:
                continue
            groups = self.groups(axis)
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
            if len(groups) > 8:
                shown += f" ... ({len(groups)} groups)"
            rows.append((axis.value, self.size(axis), shown))
        return rows


# memoised: the planner asks the same few layouts for sizes and coordinates hundreds of thousands of times
@functools.lru_cache(maxsize=8192)
def _size(layout: Layout, axis: MeshAxis) -> int:
    return layout._size(axis)


@functools.lru_cache(maxsize=8192)
def _coords(layout: Layout, rank: int) -> dict[MeshAxis, int]:
    return layout._coords(rank)
