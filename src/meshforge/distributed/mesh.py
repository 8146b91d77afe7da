"""MeshContext: the named device meshes of a run, and the single source of truth for every size.

It is built from the `distributed` config and the world size through
`planning.layout.Layout` (the same arithmetic `meshforge validate` prints), so
the meshes a run uses are exactly the layout that was validated. At world size 1
there are no meshes and every size is 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshforge.distributed.env import per_world
from meshforge.planning.layout import FLAT_DIMS, ROOT_DIMS, Layout, MeshAxis


@dataclass
class MeshContext:
    layout: Layout
    rank: int = 0
    device_type: str = "cpu"
    device_mesh: DeviceMesh | None = None
    moe_mesh: DeviceMesh | None = None
    _meshes: dict[MeshAxis, DeviceMesh] = field(default_factory=dict)

    @classmethod
    def build(cls, dcfg, world_size: int, rank: int = 0, device_type: str = "cpu",
              create_meshes: bool = True) -> MeshContext:
        layout = Layout.from_sizes(world_size, tp=dcfg.tp_size, pp=dcfg.pp_size, cp=dcfg.cp_size,
                                   ep=dcfg.ep_size, dp=dcfg.dp_size, dp_replicate=dcfg.dp_replicate_size)
        ctx = cls(layout, rank, device_type)
        if create_meshes and world_size > 1:
            ctx.device_mesh, ctx.moe_mesh, ctx._meshes = per_world(("meshes", layout, device_type), ctx._create)
        return ctx

    def _create(self) -> tuple[DeviceMesh, DeviceMesh | None, dict[MeshAxis, DeviceMesh]]:
        """(root mesh, MoE mesh, {axis: mesh}); made once per layout and process group (`env.per_world`)."""
        names = tuple(a.value for a in ROOT_DIMS)
        root = init_device_mesh(self.device_type, self.layout.shape, mesh_dim_names=names)
        meshes: dict[MeshAxis, DeviceMesh] = {a: root[a.value] for a in ROOT_DIMS}
        for flat, dims in FLAT_DIMS.items():
            meshes[flat] = root[tuple(d.value for d in dims)]._flatten(flat.value)
        moe_mesh = None
        if self.layout.ep > 1:
            # (pp, ep_shard, ep) per pipeline stage, over the dp_cp ranks of each tp coordinate
            L = self.layout
            ranks = torch.arange(L.world_size).view(L.pp, L.dp_replicate * L.dp_shard * L.cp, L.tp)
            ranks = ranks.permute(0, 2, 1).reshape(L.pp * L.tp, L.size(MeshAxis.EP_SHARD), L.ep)
            moe_root = DeviceMesh(self.device_type, ranks, mesh_dim_names=("pp_tp", "ep_shard", "ep"))
            moe_mesh = moe_root[("ep_shard", "ep")]
            meshes[MeshAxis.EP] = moe_mesh["ep"]
            meshes[MeshAxis.EP_SHARD] = moe_mesh["ep_shard"]
        return root, moe_mesh, meshes

    # ------------------------------------------------------------------ meshes
    def mesh(self, *axes: str | MeshAxis) -> DeviceMesh | None:
        """The (sub)mesh over one axis, or several root axes together; None at world size 1."""
        parsed = [MeshAxis.parse(a) for a in axes]
        if self.device_mesh is None:
            return None
        if len(parsed) == 1:
            if parsed[0] not in self._meshes:
                raise KeyError(f"mesh axis {parsed[0].value!r} does not exist in this run (ep_size=1?)")
            return self._meshes[parsed[0]]
        return self.device_mesh[tuple(a.value for a in parsed)]

    def group(self, axis: str | MeshAxis):
        m = self.mesh(axis)
        return None if m is None else m.get_group()

    def dp_shard_mesh(self) -> DeviceMesh | None:
        """The mesh data-parallel sharding uses: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP."""
        if self.device_mesh is None:
            return None
        if self.dp_replicate_size > 1:
            return self.device_mesh[("dp_replicate", "dp_shard_cp")]
        return self.mesh(MeshAxis.DP_SHARD_CP)

    # ------------------------------------------------------------------- sizes
    def size(self, axis: str | MeshAxis) -> int:
        return self.layout.size(axis)

    def local_rank(self, axis: str | MeshAxis) -> int:
        return self.layout.coords(self.rank)[MeshAxis.parse(axis)]

    world_size = property(lambda self: self.layout.world_size)
    dp_size = property(lambda self: self.layout.dp)
    dp_replicate_size = property(lambda self: self.layout.dp_replicate)
    dp_shard_size = property(lambda self: self.layout.dp_shard)
    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    cp_size = property(lambda self: self.layout.cp)
    ep_size = property(lambda self: self.layout.ep)
    dp_rank = property(lambda self: self.local_rank(MeshAxis.DP))
    tp_rank = property(lambda self: self.local_rank(MeshAxis.TP))
    pp_rank = property(lambda self: self.local_rank(MeshAxis.PP))
    cp_rank = property(lambda self: self.local_rank(MeshAxis.CP))
    ep_rank = property(lambda self: self.local_rank(MeshAxis.EP))
