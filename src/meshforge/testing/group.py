"""Many jobs in one process group: the way a test suite shares launches.

Process start costs seconds (import torch, rendezvous), a tiny training run milliseconds, so the tests of
every module hand their multi-process work to one launch per world size. A `Job` is a named call
`target(spec, info)` run on every rank of an already initialised gloo group (`info`: this rank's
`DistInfo`); `run_jobs` runs a list of them in order and returns each job's rank-0 value, or its error. A job
that fails is reported as such and the next one runs: the ranks agree on each job's outcome before moving
on, so one failure cannot leave them in different collectives.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from meshforge.distributed.env import DistInfo, destroy, init_distributed
from meshforge.launch import _resolve, launch


@dataclass(frozen=True)
class Job:
    name: str
    target: str  # "module:function" or "path/file.py:function", called as fn(spec, info) on every rank
    spec: Any = None
    nproc: int = 2
    prepare: Callable[[], None] | None = field(default=None, compare=False)  # run by the launching side first


def failed_ranks(failed: bool, info: DistInfo) -> list[int]:
    """The ranks whose part failed, agreed by every rank (so none goes on into a collective the others skip)."""
    flags: list = [failed] * info.world_size
    if info.world_size > 1:
        dist.all_gather_object(flags, failed)
    return [r for r, f in enumerate(flags) if f]


def run_jobs(spec: dict) -> dict[str, dict]:
    """Launch target: every job of `spec["jobs"]` in one gloo group; {name: {"value"} or {"error"}}."""
    info = init_distributed("cpu", timeout_minutes=spec.get("timeout_minutes", 2))
    out: dict[str, dict] = {}
    try:
        for job in spec["jobs"]:
            t0 = time.perf_counter()
            try:
                out[job["name"]] = {"value": _resolve(job["target"])(job["spec"], info)}
            except (Exception, CheckpointException) as err:  # reported to the test that owns the job
                out[job["name"]] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
            out[job["name"]]["wall_s"] = time.perf_counter() - t0
            failed = failed_ranks("error" in out[job["name"]], info)
            if failed and "error" not in out[job["name"]]:
                out[job["name"]] = {"error": f"failed on ranks {failed}"}
    finally:
        destroy()
    return out


def launch_jobs(jobs: list[Job], nproc: int, timeout: float = 1200, report=None, env: dict | None = None
                ) -> dict[str, dict]:
    """Run `jobs` (their `prepare` first, here) in one launch of `nproc` processes; rank 0's outcomes
    ({"value"} or {"error"}, and "wall_s"). `report(line)` gets one line of timings; `env` as for `launch`."""
    for job in jobs:
        if job.prepare is not None:
            job.prepare()
    spec = {"jobs": [{"name": j.name, "target": j.target, "spec": j.spec} for j in jobs]}
    res = launch("meshforge.testing.group:run_jobs", spec, nproc, timeout=timeout, env=env).check()
    if report is not None:
        jobs_s = ", ".join(f"{name} {o['wall_s']:.1f}" for name, o in res.value.items())
        report(f"launch of {nproc} processes: {res.wall_s:.1f} s wall ({jobs_s})")
    return res.value
