"""SIGTERM/SIGUSR1 (what SLURM sends before preemption) and SIGINT (Ctrl-C): finish the step, save and exit,
every rank at the same step. The CLI exits 0 after SIGTERM/SIGUSR1 (a preempted run that saved) and 130 after
SIGINT. A second SIGINT aborts at once (the first one a terminal delivers reaches the launcher too, which
forwards it: a repeat within `REPEAT_S` is that same Ctrl-C, not a second one).

A scheduler may signal only some ranks, so the ranks agree: each step starts an asynchronous MAX all-reduce of
this rank's flag over a gloo group on the CPU (one per process group, shared by every run in it), and reads the
result of the one it started the step before, which every rank reads at the same step. The flag lives in host
memory (a numpy array the tensor shares), so polling never synchronises with the device, and a signal stops the
run at most one step after it arrived.
At world size 1 the flag is read directly.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from meshforge.distributed.env import per_world


class StopSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    REPEAT_S = 2.0

    def __init__(self, world_size: int):
        self.requested = 0  # the number of the signal received (0: none); ranks agree on the largest
        self._first_sigint: float | None = None
        self._old: dict = {}
        self._group = per_world("stop-signal", lambda: dist.new_group(backend="gloo")) if world_size > 1 else None
        self._sent = np.zeros(1, dtype=np.float32)  # host memory the all-reduce writes into
        self._work = None
        self.received: str | None = None  # the agreed signal's name once poll() said stop

    def install(self) -> None:
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_sigint is not None and now - self._first_sigint > self.REPEAT_S:
                print("meshforge: second interrupt: aborting now, without saving", file=sys.stderr, flush=True)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
                return
            self._first_sigint = self._first_sigint or now
        self.requested = max(self.requested, int(signum))

    def poll(self) -> bool:
        """True when any rank has been signalled (agreed by all ranks at the same step)."""
        if self._group is None:
            got = self.requested
        else:
            got = 0
            if self._work is not None:
                self._work.wait()
                got = int(self._sent[0])
            self._sent[0] = float(self.requested)
            self._work = dist.all_reduce(torch.from_numpy(self._sent), op=dist.ReduceOp.MAX, group=self._group,
                                         async_op=True)
        if got:
            self.received = signal.Signals(got).name
        return bool(got)

    def close(self) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)
        self._old.clear()
        if self._work is not None:
            self._work.wait()
            self._work = None
