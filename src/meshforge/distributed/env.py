"""Process-group initialisation: nccl on CUDA, gloo on CPU; rank facts from torchrun/SLURM variables."""

from __future__ import annotations

import datetime
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshforge.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    """World size announced by torchrun or SLURM (1 when launched plainly)."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def _slurm_to_torch_env() -> None:
    """Map srun's variables onto torch's when meshforge is started by `srun` directly."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
        os.environ["MASTER_ADDR"] = nodes.split(",")[0].split("[")[0]


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but no CUDA device is available here: use training.device=cpu "
                          "or auto")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def choose_cuda_device_max_connections(dcfg, world_size: int, cuda: bool) -> str | None:
    """TP/CP without FSDP sharding wants CUDA_DEVICE_MAX_CONNECTIONS=1 (kernel order = issue order, so
    TP/CP collectives overlap predictably); FSDP wants it unset (the rules reject 1 there). Sets it when the
    user has not, and returns a line saying what was chosen (None when nothing applies)."""
    if not cuda:
        return None
    current = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    dp_cp = world_size // max(1, dcfg.tp_size * dcfg.pp_size)
    fsdp_sharding = dcfg.spec.shards_parameters and dp_cp > 1
    if (dcfg.tp_size > 1 or dcfg.cp_size > 1) and not fsdp_sharding:
        if current is None:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
            return "CUDA_DEVICE_MAX_CONNECTIONS=1 set for TP/CP without FSDP"
        return f"CUDA_DEVICE_MAX_CONNECTIONS={current} kept as set by the user"
    return f"CUDA_DEVICE_MAX_CONNECTIONS={current or 'unset'} (strategy {dcfg.strategy})"


def init_distributed(device: str = "auto", timeout_minutes: float = 10.0) -> DistInfo:
    _slurm_to_torch_env()
    world = env_world_size()
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return DistInfo(0, 1, 0, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                                device_id=dev if dev.type == "cuda" else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), dev, backend)


_PER_WORLD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_world(key: Any, make: Callable[[], Any]) -> Any:
    """`make()` once per (process group, key): what several runs in one process group share (their device
    meshes, a side group for polling), instead of new process groups for every run. Each new gloo group opens
    connections and threads that live as long as the process."""
    world = dist.distributed_c10d._get_default_group()
    cache = _PER_WORLD.setdefault(world, {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


def destroy() -> None:
    _PER_WORLD.clear()  # no mesh or side group of this process group outlives it
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
