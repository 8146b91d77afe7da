"""Fault injection for tests: `MESHFORGE_FAULT` names faults at controlled points of a run.

The variable holds comma-separated specs; each is `name:step[:rank[:arg]]` (rank default: the last rank):

- `kill_during_save:STEP[:RANK]`  SIGKILL this rank inside the save of step STEP, after its DCP shards and
  trainer state are written and before the manifest/rename/LATEST commit.
- `signal_at_step:STEP[:RANK[:SIG]]`  deliver a real signal (USR1 default, TERM or INT) to this rank after step STEP.
- `hang_at_step:STEP[:RANK[:SECONDS]]`  this rank sleeps SECONDS (default 3600) after step STEP instead of
  joining the next collective, so the others must time out (`distributed.timeout_minutes`).
- `nan_at_step:STEP`  every rank's loss and gradients of step STEP become NaN, to test `training.nonfinite`.

- `kill_at_step:STEP[:RANK]`  SIGKILL this rank after step STEP (a node lost mid-run).
- `storage_error:STEP[:RANK[:ERRNO]]`  this rank's write of its trainer state in the save of step STEP raises
  OSError(ERRNO) (a name: ENOSPC default, EROFS, EACCES, EIO, ...), as a full or read-only disk would.
- `slow_rank:STEP[:RANK[:SECONDS]]`  from step STEP on, this rank computes SECONDS (default 0.2) longer in every
  step: a busy loop inside the step, after backward, until the thread has used that much more CPU time (a slow
  device; the straggler report, `stragglers.py`).

A fault fires in a job's first attempt only (a restarted attempt runs clean, as after a transient fault), or in
attempt N when its name says so: `kill_during_save@1:6:0` fires in the first restart (`--max-restarts`).

The variable is read once, when a trainer is built (`install`), and the faults it names become hooks of
that trainer and its checkpoint manager: a run without it carries no fault code in its loop. A test that runs
several phases in one process sets it before each phase's trainer is built.
"""

from __future__ import annotations

import os
import errno
import signal
import sys
import time

import torch

from meshforge.distributed.grad_norm import grad_of
from meshforge.launch import restart_attempt


def parse(raw: str, rank: int, world_size: int, attempt: int = 0) -> dict[str, dict[int, list[str]]]:
    """{fault name: {step: extra args}} of the faults armed for this rank in this attempt."""
    out: dict[str, dict[int, list[str]]] = {}
    for spec in (s.strip().split(":") for s in raw.split(",") if s.strip()):
        if len(spec) < 2:
            continue
        name, _, when = spec[0].partition("@")
        if int(when or 0) != attempt:
            continue
        step = int(spec[1])
        target = int(spec[2]) if len(spec) > 2 and spec[2] != "" else world_size - 1
        if name == "nan_at_step" or target == rank:
            out.setdefault(name, {})[step] = spec[3:]
    return out


def install(trainer) -> None:
    """Arm the faults of `MESHFORGE_FAULT` (if set) as hooks of `trainer` and its checkpoint manager."""
    raw = os.environ.get("MESHFORGE_FAULT", "").strip()
    if not raw:
        return
    rank, world = trainer.info.rank, trainer.info.world_size
    faults = parse(raw, rank, world, restart_attempt()[0])

    def nan_at_step(step: int, loss: torch.Tensor) -> torch.Tensor:
        if step not in faults.get("nan_at_step", {}):
            return loss
        with torch.no_grad():  # the gradients too, so an update that is not skipped would poison the weights
            for part in trainer.pm.parts:
                for g in map(grad_of, part.parameters()):  # bf16_params: the fp32 main grad
                    if g is not None:
                        g.mul_(float("nan"))
        return loss * float("nan")

    def after_step(step: int) -> None:
        args = faults.get("signal_at_step", {}).get(step)
        if args is not None:
            name = args[0].upper().removeprefix("SIG") if args else "USR1"
            sig = {"TERM": signal.SIGTERM, "INT": signal.SIGINT}.get(name, signal.SIGUSR1)
            print(f"fault: rank {rank} sends itself {sig.name} after step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)
        if step in faults.get("kill_at_step", {}):
            print(f"fault: rank {rank} kills itself (SIGKILL) after step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        args = faults.get("hang_at_step", {}).get(step)
        if args is not None:
            seconds = float(args[0]) if args else 3600.0
            print(f"fault: rank {rank} hangs for {seconds:g} s after step {step}", file=sys.stderr, flush=True)
            time.sleep(seconds)

    def kill_during_save(step: int) -> None:
        if step in faults.get("kill_during_save", {}):
            print(f"fault: rank {rank} kills itself (SIGKILL) in the middle of saving step {step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def storage_error(step: int, path) -> None:
        args = faults.get("storage_error", {}).get(step)
        if args is not None:
            code = getattr(errno, args[0].upper() if args else "ENOSPC")
            print(f"fault: rank {rank} fails to write {path} ({errno.errorcode[code]})", file=sys.stderr, flush=True)
            raise OSError(code, os.strerror(code), str(path))

    def slow_rank(step: int, loss: torch.Tensor) -> torch.Tensor:
        since = [s for s in faults.get("slow_rank", {}) if s <= step]
        if since:
            args = faults["slow_rank"][max(since)]
            t0 = time.thread_time()
            while time.thread_time() - t0 < (float(args[0]) if args else 0.2):
                pass
        return loss

    trainer.after_backward.append(nan_at_step)
    if "slow_rank" in faults:
        trainer.after_backward.append(slow_rank)
    trainer.after_step.append(after_step)
    trainer.before_commit = kill_during_save
    trainer.before_write = storage_error
