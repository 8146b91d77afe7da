"""Stragglers' device time (training/stragglers.py) on CUDA, with a fake CUDA event class: two events are recorded
around every step, none is read before the logging step (reading one at another step would be a host sync), the
logging step reads them all and reports the slowest rank's device time beside its host time. On CPU no event is
made."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from meshforge.training import stragglers
from meshforge.training.stragglers import StepClock


class FakeEvent:
    log: list[str] = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.recorded = False

    def record(self, stream=None) -> None:
        FakeEvent.log.append("record")
        self.recorded = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.recorded and end.recorded
        FakeEvent.log.append("elapsed_time")
        return 250.0  # ms


def _step(clock: StepClock) -> None:
    clock.start()
    clock.tick("data")
    clock.stop()


def test_device_time_is_read_only_at_the_logging_step(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = StepClock(SimpleNamespace(world_size=2, device=torch.device("cuda")), ratio=1.5)
    assert clock.timed_on_device
    for step in range(3):
        _step(clock)
        assert FakeEvent.log == ["record"] * 2 * (step + 1)  # recorded (asynchronous), never read
    clock.device = torch.device("cpu")  # (the gather's tensor: this machine has no GPU)

    def all_gather(out, local):  # rank 1: 1 s of compute and 0.5 s on the device per step
        out[0].copy_(local)
        out[1].copy_(torch.tensor([1.0, 0.0, 0.5], dtype=local.dtype))

    monkeypatch.setattr(stragglers.dist, "all_gather", all_gather)
    rec, warning = clock.report(1, 3)
    assert FakeEvent.log.count("elapsed_time") == 3 and FakeEvent.log[-3:] == ["elapsed_time"] * 3
    assert rec["slowest_rank"] == 1 and rec["device_time_s"] == 0.5, rec
    assert rec["median_device_time_s"] == pytest.approx(0.25), rec  # rank 0's: 3 steps of 250 ms
    assert "compute 1.000 s, data wait 0.000 s, device 0.500 s;" in warning, warning
    assert clock._events == []
    _step(clock)
    assert FakeEvent.log.count("elapsed_time") == 3  # the next window's step reads nothing


def test_no_event_on_cpu_or_at_world_size_1(monkeypatch):
    def no_event(*_a, **_k):
        raise AssertionError("a CUDA event was made")

    monkeypatch.setattr(torch.cuda, "Event", no_event)
    for info in (SimpleNamespace(world_size=2, device=torch.device("cpu")),
                 SimpleNamespace(world_size=1, device=torch.device("cuda"))):
        clock = StepClock(info, ratio=1.5)
        _step(clock)
        assert not clock.timed_on_device and clock._events == []
