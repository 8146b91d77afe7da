"""Stragglers: which rank holds the others back, from each rank's own time per step, gathered at logging steps only.

In a synchronous step every rank's wall time is the same: a fast rank waits inside the step's collectives (the
label count, the gradient reduction, FSDP's gathers) for the slow one, so wall time names nobody. Each rank's own
time is what it spends itself:
- compute: the CPU time of the training thread over the step, less what getting the batch took. A rank blocked in
  a collective sleeps in the kernel (gloo waits on its sockets), which adds wall time and no CPU time, so the
  waiting drops out without timing any strategy's collectives (wall time minus time blocked in collectives would
  need every collective of every strategy timed, DDP's reducer inside C++ included).
- data wait: the wall time of getting the batch (`loader.next_batch`): a rank whose data pipeline lags.
Own time = compute + data wait. A step only reads two clocks (no device read, no collective); at a logging step one
all_gather of two floats per rank gives the slowest rank and its ratio to the lower median of every rank's own time
(at 2 ranks: the other rank) for metrics.jsonl and the progress line, and a warning past `logging.straggler_ratio`.

On CUDA the host runs ahead of the device, so the training thread's CPU time is its launch work, not the GPU's:
the own time finds host-side stragglers (data, Python, a busy CPU). Beside it each rank reports its device time:
two CUDA events recorded on the training stream around each step (recording one is asynchronous), read only at
the logging step, after that step's existing device synchronisation (`elapsed_time`, no new host sync). The
device time is the stream's wall time over the step, so it includes time the GPU waits in a collective for the
others: a slow GPU shows as every rank's device time growing beyond its host time, not as one rank's alone.
Pipeline stages do unequal work by design (the first and last hold the embedding and the head); their ratios say
so.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class StepClock:
    """Each step's own time on this rank (`start`, `tick` as `train_step`'s clock, `stop`), summed until `report`."""

    def __init__(self, info, ratio: float | None):
        self.world, self.device, self.ratio = info.world_size, info.device, ratio
        self.compute = self.data = 0.0
        self.steps = 0
        self.rows: list[tuple[float, ...]] = []  # the last report's (compute, data wait[, device]) of every rank
        self._wall0 = self._cpu0 = self._data_wall = self._data_cpu = 0.0
        self.timed_on_device = self.device.type == "cuda" and self.world > 1
        self._events: list[tuple] = []  # (start, end) CUDA events of the steps since the last report

    def start(self) -> None:
        self._wall0, self._cpu0 = time.perf_counter(), time.thread_time()
        self._data_wall = self._data_cpu = 0.0
        if self.timed_on_device:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()

    def tick(self, part: str) -> None:
        if part == "data":
            self._data_wall, self._data_cpu = time.perf_counter() - self._wall0, time.thread_time() - self._cpu0

    def stop(self) -> None:
        if self._events:
            self._events[-1][1].record()
        self.compute += time.thread_time() - self._cpu0 - self._data_cpu
        self.data += self._data_wall
        self.steps += 1

    def device_time(self) -> float:
        """The device's seconds over the steps since the last report (CUDA), read after the logging step's
        device synchronisation; 0 elsewhere."""
        events, self._events = self._events, []
        return sum(start.elapsed_time(end) for start, end in events) / 1000.0

    def report(self, first: int, last: int) -> tuple[dict, str | None]:
        """On every rank at a logging step (the steps first..last since the previous one): the record's straggler
        fields and the warning past the ratio (None below it); nothing at world size 1."""
        steps, mine = self.steps, [self.compute, self.data] + ([self.device_time()] if self.timed_on_device else [])
        self.compute = self.data = 0.0
        self.steps = 0
        if self.world == 1 or not steps:
            return {}, None
        local = torch.tensor([v / steps for v in mine], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local)
        self.rows = [tuple(r) for r in torch.stack(gathered).tolist()]
        own = [r[0] + r[1] for r in self.rows]
        slowest = max(range(self.world), key=own.__getitem__)
        median = statistics.median_low(own)
        ratio = own[slowest] / median if median > 0 else 1.0
        rec = {"slowest_rank": slowest, "slowest_ratio": ratio, "rank_time_s": own[slowest],
               "median_rank_time_s": median, "data_wait_s": self.rows[slowest][1]}
        device = ""
        if self.timed_on_device:  # the same rank's device time, and the median rank's
            rec["device_time_s"] = self.rows[slowest][2]
            rec["median_device_time_s"] = statistics.median_low(r[2] for r in self.rows)
            device = f", device {rec['device_time_s']:.3f} s"
        warning = None
        if self.ratio is not None and ratio > self.ratio:
            c, d = self.rows[slowest][:2]
            warning = (f"warning: straggler: rank {slowest} took {ratio:.2f}x the median rank's own time per step "
                       f"over steps {first}-{last} ({own[slowest]:.3f} s vs {median:.3f} s: compute {c:.3f} s, data "
                       f"wait {d:.3f} s{device}; logging.straggler_ratio={self.ratio:g})")
        return rec, warning
