"""A training step that does not log never waits for the device: zero host synchronisations.

Counted while `Trainer.fit` runs, step by step (between consecutive `after_step` hooks, so a window holds one
step and the loop's own work after the previous one: signal poll, checkpoint and logging decisions):
- every Python-level read of a tensor's value: `.item()`, `float()`, `int()`, `bool()`, `.tolist()`, `.cpu()`,
  `.numpy()`;
- every `aten::_local_scalar_dense` under a dispatch mode, which is what any read of a scalar becomes,
  including from C++ inside torch.
Steps 2..5 of a 6-step run with `logging.log_every=100` must show zero of both, at world size 1 (in this
process) and 2 (a job of the shared launch), for ddp, fsdp2 and megatron_fsdp; after the last step, which logs,
the read-back of the window shows up. The default optimizer (fused AdamW) skips non-finite steps on the
device; with `optimizer.impl=foreach` the loop reads the flag every step, and this test sees it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.testing.group import Job
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import Trainer

pytestmark = pytest.mark.dist
STRATEGIES = ("ddp", "fsdp2", "megatron_fsdp")
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")


class _ScalarReads(TorchDispatchMode):
    def __init__(self, counts: dict):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["_local_scalar_dense"] = self.counts.get("_local_scalar_dense", 0) + 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(strategy: str, info, extra: tuple = ()) -> list[dict]:
    """{read: count} for each step of a 6-step run (index 0 = step 1), then what followed the last step."""
    cfg = config([f"distributed.strategy={strategy}", "logging.log_every=100", *extra], steps=6,
                 world_size=info.world_size)
    trainer = Trainer.build(cfg, info)
    counts: dict = {}
    per_step: list[dict] = []

    def after_step(step: int) -> None:
        per_step.append(dict(counts))
        counts.clear()

    trainer.after_step.append(after_step)
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, fn):
        def wrapper(self, *a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *a, **k)
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, counting(name, fn))
        with _ScalarReads(counts):
            trainer.fit()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    return per_step + [counts]


def sync_job(spec, info) -> dict:
    return {s: syncs_per_step(s, info) for s in STRATEGIES}


GROUP_JOBS = [Job("host syncs n2", f"{Path(__file__).resolve()}:sync_job", None, 2)]


def _check(per_step: list[dict], label: str) -> None:
    print(f"{label}: host syncs per step {per_step}")
    assert len(per_step) == 7
    assert per_step[1:5] == [{}] * 4, f"{label}: a non-logging step read the device: {per_step[1:5]}"
    assert per_step[6].get("tolist", 0) >= 1, f"{label}: the log step read nothing back: {per_step[6]}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_host_sync_on_a_non_logging_step_world_1(strategy):
    _check(syncs_per_step(strategy, single_info()), f"{strategy} N=1")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_host_sync_on_a_non_logging_step_world_2(group, strategy):
    _check(group("host syncs n2")[strategy], f"{strategy} N=2")


def test_the_count_sees_a_sync():
    """The counter is not blind: a host-checked optimizer reads the non-finite flag on every step."""
    per_step = syncs_per_step("fsdp2", single_info(), ("optimizer.impl=foreach",))
    assert all(s.get("__bool__", 0) >= 1 for s in per_step[1:5]), per_step
