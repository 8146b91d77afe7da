"""The learning-rate schedules as curves: WSD (warmup, stable, decay in three shapes) step by step, through
the optimizer torch steps (the LambdaLR the trainer builds), and its config checks."""

from __future__ import annotations

import math

import pytest
import torch

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.training.optim import build_scheduler

PEAK, LO = 1e-3, 0.1


def _curve(overrides: list[str], steps: int) -> list[float]:
    cfg = load_config(None, [f"training.max_steps={steps}", f"optimizer.lr={PEAK}", *overrides])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimizer.lr)
    sched = build_scheduler(opt, cfg.scheduler, cfg.training.max_steps)
    lrs = []
    for _ in range(steps):  # the lr each optimizer step uses, as the trainer steps them
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("style, shape", [
    ("linear", lambda t: 1 - t), ("cosine", lambda t: 0.5 * (1 + math.cos(math.pi * t))),
    ("sqrt", lambda t: 1 - math.sqrt(t))])
def test_wsd_curve(style, shape):
    lrs = _curve(["scheduler.name=wsd", "scheduler.warmup_steps=4", "scheduler.decay_steps=5",
                  f"scheduler.min_lr_ratio={LO}", f"scheduler.decay_style={style}"], steps=20)
    assert lrs[:4] == pytest.approx([PEAK * k / 4 for k in (1, 2, 3, 4)])  # linear warmup
    assert lrs[4:15] == pytest.approx([PEAK] * 11)  # stable: the peak until the decay phase
    want = [PEAK * (LO + (1 - LO) * shape(k / 5)) for k in (1, 2, 3, 4, 5)]
    assert lrs[15:] == pytest.approx(want)  # decay over the last 5 steps, the last exactly at min_lr
    assert lrs[-1] == pytest.approx(PEAK * LO)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_wsd_shapes_differ_and_default_is_linear():
    base = ["scheduler.name=wsd", "scheduler.decay_steps=8"]
    lin, cos, sq = (_curve([*base, f"scheduler.decay_style={s}"], 16) for s in ("linear", "cosine", "sqrt"))
    assert _curve(base, 16) == lin
    mid = 9  # a quarter down: sqrt falls fastest early, cosine slowest
    assert sq[mid] < lin[mid] < cos[mid]


def test_cosine_and_linear_unchanged():
    cos = _curve(["scheduler.warmup_steps=2", f"scheduler.min_lr_ratio={LO}"], 10)
    t = [(s - 2) / 8 for s in range(2, 10)]
    assert cos[2:] == pytest.approx([PEAK * (LO + (1 - LO) * 0.5 * (1 + math.cos(math.pi * x))) for x in t])
    lin = _curve(["scheduler.name=linear", f"scheduler.min_lr_ratio={LO}"], 10)
    assert lin == pytest.approx([PEAK * (1 - (1 - LO) * s / 10) for s in range(10)])


@pytest.mark.parametrize("overrides, msg", [
    (["scheduler.name=wsd"], "needs scheduler.decay_steps"),
    (["scheduler.decay_style=sqrt"], "only read by scheduler.name=wsd"),
    (["scheduler.name=wsd", "scheduler.decay_steps=8", "scheduler.warmup_steps=5", "training.max_steps=10"],
     "exceeds training.max_steps=10"),
    (["scheduler.name=wsd", "scheduler.decay_steps=2", "scheduler.decay_style=exp"], "scheduler.decay_style"),
])
def test_wsd_config_is_checked(overrides, msg):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert len(err.value.problems) == 1 and msg in err.value.problems[0], err.value.problems
