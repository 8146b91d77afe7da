"""Shared launches and references, so the suite stays fast as it grows.

- Multi-process work is declared, not launched, by each test module: a module-level `GROUP_JOBS` list of
  `meshforge.testing.group.Job`. After collection, the jobs of every module with a selected test are run in
  ONE launch per world size, the N=4 launch before the N=2 one (an N=2 job may read what an N=4 job wrote,
  e.g. a checkpoint to reshard), in a background thread from the start of the session; the tests that need
  them run last, so the rest of the suite runs meanwhile. A test asks `group("job name")` for its job's
  rank-0 value (waiting for its launch).
- Single-process references are computed once per (overrides, steps) for the whole session (`reference`).
- `$MESHFORGE_TEST_SHARED` is a session directory jobs can write into (their specs are built at import time,
  and launched workers that import a test module by path inherit the variable).

Tiers: `dist` marks tests that launch processes, `slow` the ones that take tens of seconds more;
`python -m pytest -m "not dist and not slow" tests` is the fast tier.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import pytest  # noqa: E402

SHARED = Path(tempfile.mkdtemp(prefix="meshforge-tests-"))
os.environ["MESHFORGE_TEST_SHARED"] = str(SHARED)


class _Launches:
    """The shared launches, run one after another in a background thread; `result(name)` waits for its own."""

    def __init__(self):
        self.jobs: dict[int, list] = {}
        self.owner: dict[str, int] = {}
        self.outcomes: dict[str, dict] = {}
        self.failed: dict[int, str] = {}
        self.done = {}
        self.timings: list[str] = []

    def add(self, job) -> None:
        if job.name in self.owner:
            raise pytest.UsageError(f"group job {job.name!r} is declared twice")
        self.owner[job.name] = job.nproc
        self.jobs.setdefault(job.nproc, []).append(job)

    def start(self) -> None:
        # the environment now: tests running meanwhile set variables (MESHFORGE_FAULT) the launches must not see
        self.env = dict(os.environ)
        self.done = {n: threading.Event() for n in self.jobs}
        threading.Thread(target=self._run, name="shared-launches", daemon=True).start()

    def _run(self) -> None:
        from meshforge.testing.group import launch_jobs

        for nproc in sorted(self.jobs, reverse=True):  # writers (bigger worlds) before readers
            try:
                self.outcomes.update(launch_jobs(self.jobs[nproc], nproc, report=self.timings.append, env=self.env))
            except Exception as err:  # noqa: BLE001 - every test of this launch fails with it
                self.failed[nproc] = str(err)
            self.done[nproc].set()

    def result(self, name: str):
        if name not in self.owner:
            raise KeyError(f"no group job {name!r}: declare it in the module's GROUP_JOBS")
        nproc = self.owner[name]
        self.done[nproc].wait()
        if nproc in self.failed:
            pytest.fail(f"the shared launch of {nproc} processes failed:\n{self.failed[nproc]}")
        out = self.outcomes[name]
        if "error" in out:
            pytest.fail(f"group job {name} failed:\n{out['error']}")
        return out["value"]


_LAUNCHES = _Launches()


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: launch only what the selected tests wait for
def pytest_collection_modifyitems(config, items):
    for module in dict.fromkeys(item.module for item in items if "group" in item.fixturenames):
        for job in getattr(module, "GROUP_JOBS", ()):
            _LAUNCHES.add(job)
    # the tests that wait for the shared launches last, so everything else runs while they are under way
    items.sort(key=lambda item: "group" in item.fixturenames)
    if _LAUNCHES.jobs:
        _LAUNCHES.start()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SHARED, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    for line in _LAUNCHES.timings:
        terminalreporter.write_line(f"shared {line}")


@pytest.fixture
def tmp_run(tmp_path):
    """Overrides that send a run's outputs into a temporary directory."""
    return [f"run.output_dir={tmp_path / 'run'}"]


@pytest.fixture(scope="session")
def group():
    """`group(name)` -> the rank-0 value of group job `name` (fails the test with the job's error)."""
    return _LAUNCHES.result


@pytest.fixture(scope="session")
def reference():
    """`reference(overrides, steps=10)` -> the single-process RunResult, computed once per session."""
    from meshforge.testing.parity import run_single

    cache: dict = {}

    def get(overrides=(), steps: int = 10):
        key = (tuple(overrides), steps)
        if key not in cache:
            cache[key] = run_single(list(overrides), steps=steps)
        return cache[key]

    return get


@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MiB tmpfs (room for one checkpoint of the test model, not two); skipped where it cannot be mounted."""
    from meshforge.testing.disk import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "2500k") as why_not:
        if why_not:
            pytest.skip(why_not)
        yield tmp_path / "disk"
