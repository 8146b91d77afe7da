"""AdamW and the learning-rate schedule (linear warmup, then cosine, linear or constant)."""

from __future__ import annotations

import math

import torch


def optimizer_impl(ocfg) -> str:
    """`auto` is fused on every device: one kernel per step, and it skips a non-finite step on the device
    (`found_inf`, see nonfinite.py) where foreach/for_loop need a host check."""
    return "fused" if ocfg.impl == "auto" else ocfg.impl


def build_optimizer(param_groups: list[dict], ocfg) -> torch.optim.Optimizer:
    impl = optimizer_impl(ocfg)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(param_groups, lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps,
                             weight_decay=ocfg.weight_decay, **kwargs)


def lr_factor(step: int, scfg, max_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if scfg.warmup_steps and step < scfg.warmup_steps:
        return (step + 1) / scfg.warmup_steps
    if scfg.name == "constant":
        return 1.0
    decay = scfg.decay_steps or max(1, max_steps - scfg.warmup_steps)
    t = min(1.0, (step - scfg.warmup_steps) / decay)
    lo = scfg.min_lr_ratio
    if scfg.name == "linear":
        return 1.0 - (1.0 - lo) * t
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer, scfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, scfg, max_steps))
