"""AdamW and the learning-rate schedule: linear warmup, then cosine, linear or constant, or WSD.

WSD (warmup-stable-decay, as in MiniCPM, torchtitan, Megatron-Bridge): the peak lr after warmup until the
last `decay_steps` steps, which decay to `min_lr_ratio` along `decay_style` (linear, cosine, or sqrt:
1 - sqrt(t)). The stable phase can be stopped anywhere and decayed later, which is why people want it.
Muon is not offered: its Newton-Schulz update needs whole matrices, which fsdp2 and megatron_fsdp shard
(an exact sharded Muon needs a gather per matrix per step; not built, so not exposed)."""

from __future__ import annotations

import math

import torch

from meshforge.distributed.master_weights import MasterWeightAdamW, needs_master_weights


def optimizer_impl(ocfg) -> str:
    """`auto` is fused on every device: one kernel per step, and it skips a non-finite step on the device
    (`found_inf`, see nonfinite.py) where foreach/for_loop need a host check."""
    return "fused" if ocfg.impl == "auto" else ocfg.impl


def build_optimizer(param_groups: list[dict], ocfg) -> torch.optim.Optimizer:
    impl = optimizer_impl(ocfg)
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    # bf16 parameters (training.precision=bf16_params at world size 1): the update runs on fp32 masters
    cls = MasterWeightAdamW if needs_master_weights(param_groups) else torch.optim.AdamW
    return cls(param_groups, lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps,
               weight_decay=ocfg.weight_decay, **kwargs)


def lr_factor(step: int, scfg, max_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if scfg.warmup_steps and step < scfg.warmup_steps:
        return (step + 1) / scfg.warmup_steps
    if scfg.name == "constant":
        return 1.0
    lo = scfg.min_lr_ratio
    if scfg.name == "wsd":
        start = max_steps - scfg.decay_steps  # the first step of the decay phase
        if step < start:
            return 1.0
        # the decay phase's last step (max_steps - 1) lands exactly on min_lr_ratio
        t = min(1.0, (step - start + 1) / scfg.decay_steps)
        return lo + (1.0 - lo) * _decay_shape(scfg.decay_style or "linear", t)
    decay = scfg.decay_steps or max(1, max_steps - scfg.warmup_steps)
    t = min(1.0, (step - scfg.warmup_steps) / decay)
    return lo + (1.0 - lo) * _decay_shape("linear" if scfg.name == "linear" else "cosine", t)


def _decay_shape(style: str, t: float) -> float:
    """1 at t=0 falling to 0 at t=1."""
    if style == "linear":
        return 1.0 - t
    if style == "sqrt":
        return 1.0 - math.sqrt(t)
    return 0.5 * (1.0 + math.cos(math.pi * t))


def build_scheduler(optimizer, scfg, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, scfg, max_steps))
