"""The few collectives a checkpoint needs, written so they also run without a process group (one process, an
offline export), and the rank-0 log line.

Every rank calls `barrier` and `all_gather_object` together; `log` prints on rank 0 only (warnings to stderr).
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(group=None) -> None:
    if dist_on():
        dist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    if not dist_on():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world() -> int:
    return dist.get_world_size() if dist_on() else 1


def log(msg: str, warn: bool = False) -> None:
    if rank() == 0:
        print(f"{'warning: ' if warn else ''}checkpoint: {msg}", file=sys.stderr if warn else sys.stdout,
              flush=True)
