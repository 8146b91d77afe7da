"""The fake world of one traced rank: torch's fake process group, fake tensors, the run's device defaults.

Facts this rests on (torch 2.13, measured):
- `dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)` (backend registered by
  `torch.testing._internal.distributed.fake_pg`) makes rank r of any N in microseconds; its collectives return at
  once and leave their outputs as they were. DeviceMesh over it builds every group of a 16,384-rank 5-D layout in
  about a second.
- DeviceMesh does arithmetic on its rank tensor (`tolist`, `nonzero`), which FakeTensorMode refuses: meshes must
  be made outside the fake mode, FSDP2's TP x DP mesh concatenation included. So a traced rank is built on the
  meta device outside it (as meshforge builds every large model) and only materialised under it.
- `nn.Module.to()` on fake parameters fails (it swaps tensors, and fake tensors carry weak references);
  `to_empty` does not: hence the meta path (`model.init_device=meta`).
The run's device defaults (bf16 gathers and compute buffers, compile on) are those of the device the config
names, `cuda` unless `training.device: cpu` (`distributed.env.device_policy`), while it runs on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from meshforge.distributed.env import device_policy
from meshforge.errors import ConfigError


_WORLD: list[tuple[int, int]] = []  # the (world size, rank) of this process's fake group


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, device_type: str) -> Iterator[FakeTensorMode]:
    """Rank `rank` of a `world_size`-rank fake process group, taking `device_type`'s defaults; yields the fake
    tensor mode the rank's tensors live in.

    The group serves every trace of the same (world size, rank); another rank of the same world size needs
    another process (`worker.py`). Why: DeviceMesh objects of two groups with the same layout compare equal, and
    DTensor caches what it derives from a mesh (sharding propagation, redistribution plans) by it, with the
    process-group names of the first; after the first group is destroyed those names resolve to nothing ("Could
    not resolve the process group", measured, torch 2.13). A world of another size may follow in the same
    process: a mesh's equality includes its root's whole rank map, so no mesh of it equals an earlier one."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if _WORLD and _WORLD[-1] != (world_size, rank):
        earlier = [r for w, r in _WORLD if w == world_size]
        if earlier:  # its group is gone, and its meshes are still in DTensor's caches
            raise ConfigError(f"this process traced rank {earlier[0]} of {world_size} before rank {_WORLD[-1][1]} of "
                              f"{_WORLD[-1][0]}: trace rank {rank} of {world_size} in another process "
                              "(meshforge.scale.worker)")
        dist.destroy_process_group()
    if not _WORLD or _WORLD[-1] != (world_size, rank):
        if dist.is_initialized():
            raise ConfigError("the scale trace makes its own (fake) process group: run it outside a distributed job")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        _WORLD.append((world_size, rank))
    with device_policy(device_type):
        yield FakeTensorMode(allow_non_fake_inputs=True)
