"""Fault injection for tests: `MESHFORGE_FAULT` names faults at controlled points of a run.

The variable holds comma-separated specs; each is `name:step[:rank[:arg]]` (rank default: the last rank):

- `kill_during_save:STEP[:RANK]`  SIGKILL this rank inside the save of step STEP, after its DCP shards and
  trainer state are written and before the manifest/rename/LATEST commit (checkpoint/manager.py).
- `signal_at_step:STEP[:RANK[:SIG]]`  deliver a real signal (USR1 default, or TERM) to this rank after step
  STEP (from `CheckpointManager.maybe_save`, which the trainer calls after every step).
- `hang_at_step:STEP[:RANK[:SECONDS]]`  this rank sleeps SECONDS (default 3600) after step STEP instead of
  joining the next collective, so the others must time out (`distributed.timeout_minutes`).
- `nan_at_step:STEP`  every rank's loss and gradients of step STEP become NaN (training/trainer.py calls
  `inject_nan` once per step), to test `training.nonfinite`.

The variable is read on every call, so a test that runs several phases in one process can change it.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _specs() -> list[list[str]]:
    raw = os.environ.get("MESHFORGE_FAULT", "").strip()
    return [s.strip().split(":") for s in raw.split(",") if s.strip()]


def matching(name: str, step: int, rank: int, world_size: int) -> list[str] | None:
    """The spec's extra arguments if fault `name` is armed for this step and rank, else None."""
    for spec in _specs():
        if spec[0] != name or len(spec) < 2 or int(spec[1]) != step:
            continue
        target = int(spec[2]) if len(spec) > 2 and spec[2] != "" else world_size - 1
        if name == "nan_at_step" or target == rank:
            return spec[3:]
    return None


def kill_during_save(step: int, rank: int, world_size: int) -> None:
    if matching("kill_during_save", step, rank, world_size) is not None:
        print(f"fault: rank {rank} kills itself (SIGKILL) in the middle of saving step {step}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(step: int, rank: int, world_size: int) -> None:
    args = matching("signal_at_step", step, rank, world_size)
    if args is not None:
        sig = signal.SIGTERM if args and args[0].upper() in ("TERM", "SIGTERM") else signal.SIGUSR1
        print(f"fault: rank {rank} sends itself {sig.name} after step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), sig)
    args = matching("hang_at_step", step, rank, world_size)
    if args is not None:
        seconds = float(args[0]) if args else 3600.0
        print(f"fault: rank {rank} hangs for {seconds:g} s after step {step}", file=sys.stderr, flush=True)
        time.sleep(seconds)


def inject_nan(loss, step: int, pm=None):
    """Make step `step`'s loss (and the gradients, so an update that is not skipped would poison the weights) NaN."""
    if matching("nan_at_step", step, 0, 1) is None:
        return loss
    import torch

    with torch.no_grad():
        for part in (pm.parts if pm is not None else []):
            for p in part.parameters():
                if p.grad is not None:
                    p.grad.mul_(float("nan"))
    return loss * float("nan")
