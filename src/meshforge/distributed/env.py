"""Process-group initialisation: nccl on CUDA, gloo on CPU; rank facts from torchrun/SLURM variables."""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import weakref
from collections.abc import Callable, Mapping
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


# SLURM's special step ids (slurm.h: SLURM_PENDING_STEP 0xfffffffd, SLURM_EXTERN_CONT, SLURM_BATCH_SCRIPT,
# SLURM_INTERACTIVE_STEP ...): a process of one of these is not an srun task, whatever SLURM_PROCID says
_SPECIAL_STEPS = range(0xFFFFFFF0, 0x100000000)


def in_srun_task(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one task of an `srun` step (SLURM started it as one rank of many), not the
    `sbatch` script or an `salloc` shell: those carry SLURM_PROCID=0 and the job's task count too, but no step id
    (SLURM_STEP_ID, or SLURM_STEPID of older SLURM) or the batch/extern/interactive step's."""
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env:
        return False
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    return step.isdigit() and int(step) not in _SPECIAL_STEPS


def env_world_size() -> int:
    """World size announced by torchrun or an srun step (1 when launched plainly, or from an sbatch script)."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"])
    if in_srun_task():
        return int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1)
    return 1


# MASTER_PORT of an srun step: PORT_BASE + (job * STEPS_PER_JOB + step) mod PORT_SPAN. The span is prime, so two
# steps get one port only when (their job ids' difference) * STEPS_PER_JOB + (their step ids' difference) is a
# multiple of it: never for steps 0..63 of jobs whose ids differ by less than PORT_SPAN / STEPS_PER_JOB (312), nor
# for the same step id of jobs whose ids differ by less than PORT_SPAN. 10000..30010 stays below Linux's ephemeral
# ports (32768-60999), which the kernel hands to outgoing connections.
PORT_BASE, PORT_SPAN, STEPS_PER_JOB = 10000, 20011, 64


def slurm_master_port(env: Mapping[str, str]) -> int:
    """The rendezvous port every task of one srun step derives alike: the first port SLURM reserved for the step
    (`srun --resv-ports`) when it did, else one from the job id and the step id (`PORT_BASE` above), so concurrent
    steps of one job and jobs sharing a first node do not take each other's port."""
    reserved = re.match(r"\s*(\d+)", env.get("SLURM_STEP_RESV_PORTS", ""))
    if reserved:
        return int(reserved[1])
    job = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0").strip()
    if not job.isdigit():
        return 29500
    return PORT_BASE + (int(job) * STEPS_PER_JOB + (int(step) if step.isdigit() else 0)) % PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order: "gpu-[07-09,12],login1" ->
    gpu-07 gpu-08 gpu-09 gpu-12 login1 (zero padding kept; several bracket groups in one name expand as a
    product, "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            if nodelist[start:i].strip():
                names.append(nodelist[start:i].strip())
            start = i + 1
    out = []
    for name in names:
        parts = re.split(r"\[([^\]]*)\]", name)  # text, ranges, text, ranges, ..., text
        hosts = [""]
        for k, part in enumerate(parts):
            if k % 2 == 0:
                hosts = [h + part for h in hosts]
                continue
            items = []
            for rng in part.split(","):
                lo, _, hi = rng.partition("-")
                items += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
            hosts = [h + item for h in hosts for item in items]
        out += hosts
    return out


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """SLURM_TASKS_PER_NODE ("4(x2),3": 4 on nodes 0-1, 3 on node 2) -> the count on `node_id`."""
    counts = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            return None
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node_id] if node_id < len(counts) else None


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables of one `srun` task (one task per process), derived from SLURM's:
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (node), GROUP_WORLD_SIZE (nodes), and
    MASTER_ADDR = the first host of the step (block distribution puts rank 0 there), MASTER_PORT =
    `slurm_master_port`. Variables already set win; {} when not inside an srun task (an sbatch script is not one:
    `in_srun_task`) or under torchrun."""
    if "RANK" in env or not in_srun_task(env):
        return {}
    node_id = int(env.get("SLURM_NODEID", 0))
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "1"),
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "GROUP_RANK": str(node_id),
           "GROUP_WORLD_SIZE": env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1"))}
    local = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")), node_id)
    if local is not None:
        out["LOCAL_WORLD_SIZE"] = str(local)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    out["MASTER_ADDR"] = expand_nodelist(nodelist)[0] if nodelist else "127.0.0.1"
    out["MASTER_PORT"] = str(slurm_master_port(env))
    return {k: v for k, v in out.items() if k not in env}


def apply_slurm_env() -> None:
    """Map srun's variables onto torch's when meshforge is started by `srun` directly (idempotent). Call it
    before anything reads RANK: rank-0-only work done earlier would run on every task."""
    os.environ.update(slurm_env(os.environ))


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


_POLICY_DEVICE: list[str] = []  # the device type whose defaults a run takes, when it emulates another device


@contextlib.contextmanager
def device_policy(device_type: str):
    """Take `device_type`'s defaults while running on another device: the scale trace (`meshforge.scale`) runs a
    CUDA run's choices (bf16 gathers and compute buffers, `training.compile: auto` on) on CPU. Only the choices
    read through `policy_device_type` change; what must run on the device itself keeps the real one."""
    _POLICY_DEVICE.append(device_type)
    try:
        yield
    finally:
        _POLICY_DEVICE.pop()


def policy_device_type(device: torch.device) -> str:
    """The device type whose defaults (dtype policies, compile: auto) a run on `device` takes."""
    return _POLICY_DEVICE[-1] if _POLICY_DEVICE else device.type


def init_distributed(device: str = "auto", timeout_minutes: float = 10.0) -> DistInfo:
    apply_slurm_env()
    world = env_world_size()
    dev = pick_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1:
        return DistInfo(0, 1, 0, dev, None)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                                    device_id=dev if dev.type == "cuda" else None)
        except Exception as err:  # noqa: BLE001 - torch's DistNetworkError or RuntimeError, by message
            from meshforge.launch import address_in_use

            if not address_in_use(err):
                raise
            raise ConfigError(f"MASTER_ADDR:MASTER_PORT={os.environ.get('MASTER_ADDR')}:"
                              f"{os.environ.get('MASTER_PORT')}: the port is in use (another job or a leftover "
                              "process holds it): set another MASTER_PORT") from None
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
