"""Generation over several processes (`meshforge generate --nproc-per-node N`): tensor parallelism over all N ranks.

Every rank loads the whole model (as one process would: generation/load.py) and `apply_tp` shards it with the
model's own TP plan (a model without one is refused, one line); each rank then holds and caches its heads, and the
vocabulary-sharded logits are gathered before the choice, so every rank picks the same token and runs the same
forwards (generation/decode.py). Rank 0 prints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from meshforge.config.schema import DistributedConfig
from meshforge.distributed.env import DistInfo, destroy, init_distributed
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.tensor_parallel import apply_tp


@contextlib.contextmanager
def launched_rank(device: str) -> Iterator[DistInfo]:
    """This rank's place in the launch: the process group, made here (and destroyed after) unless the caller made
    it."""
    owns = not dist.is_initialized()
    info = init_distributed(device, timeout_minutes=10)
    try:
        yield info
    finally:
        if owns:
            destroy()


def shard_tp(model: torch.nn.Module, info: DistInfo) -> None:
    """Shard the loaded model in place over every rank (tp_size = world size)."""
    dcfg = DistributedConfig(tp_size=info.world_size)
    mesh_ctx = MeshContext.build(dcfg, info.world_size, info.rank, info.device.type)
    apply_tp(model, mesh_ctx, dcfg)
