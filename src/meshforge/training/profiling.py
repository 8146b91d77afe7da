"""`profiling.enabled`: a torch.profiler trace of optimizer steps `profiling.steps = [first, last]`, per rank.

Each rank writes `<dir>/trace_rank<R>.json` (Chrome trace format: open it in Perfetto, chrome://tracing or
TensorBoard's profiler plugin). Every profiled step is one `ProfilerStep#<n>` range, n the run's own 1-based
optimizer step, the name torch's own step markers use, so the viewers group by step. With
`profiling.memory_snapshot` (CUDA only) each rank also records its allocator history over the same steps and
writes `memory_rank<R>.pickle`, which https://pytorch.org/memory_viz opens. The profiler starts at `first`,
not at step 1: the steps before it are the warm-up, and nothing is recorded (or slowed) outside the window.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from meshforge.errors import ConfigError


class StepProfiler:
    def __init__(self, pcfg, output_dir: str, rank: int, device: torch.device,
                 note: Callable[[str], None] = print):
        self.enabled, self.rank, self.note = pcfg.enabled, rank, note
        if not self.enabled:
            return
        if pcfg.memory_snapshot and device.type != "cuda":
            raise ConfigError([f"profiling.memory_snapshot=true needs CUDA (this run is on {device.type}): set it "
                               "false; the trace works on CPU"])
        self.first, self.last = pcfg.steps
        self.snapshot = pcfg.memory_snapshot
        self.dir = Path(pcfg.dir or Path(output_dir) / "profile")
        self.prof: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Wrap optimizer step `n` (1-based): starts the profiler at `first`, writes the files after `last`."""
        if not self.enabled or not self.first <= n <= self.last:
            yield
            return
        if self.prof is None:
            self._start()
        with torch.profiler.record_function(f"ProfilerStep#{n}"):
            yield
        if n == self.last:
            self.close()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()

    def close(self) -> None:
        """Stop and write (also when the run ends inside the window, e.g. on a stop signal)."""
        if not self.enabled or self.prof is None:
            return
        prof, self.prof, self.enabled = self.prof, None, False
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        written = [trace.name]
        if self.snapshot:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(f"memory_rank{self.rank}.pickle")
        self.note(f"profiler: steps {self.first}-{self.last} -> {self.dir}/ ({', '.join(written)} per rank)")
