"""Rotary position tables, the one implementation (`RopeSpec` says which): plain, linear, Llama 3.1 and YaRN
frequency scaling, as transformers' `modeling_rope_utils` computes them, for every model: Llama-style decoders (one
table), models whose layers use different tables (Gemma 3: a local base for sliding-window layers, the scaled global
one for full-attention layers; GPT-OSS: YaRN everywhere) and DeepSeek-V3's rotary half (YaRN with `mscale`).

A table is the inverse frequencies and an attention factor that multiplies cos and sin (YaRN's, from `mscale` /
`mscale_all_dim` where given, else `0.1 ln(factor) + 1`, so q.k scales by its square); `tables(positions, ...)`
gives the (cos, sin) that `llama.apply_rope` takes, for true token positions (packed documents and
context-parallel shards bring theirs). models/yarn.py holds YaRN's fields and config.json keys.
"""

from __future__ import annotations

import math

import torch

from meshforge.models.layer_types import RopeSpec

__all__ = ["RopeSpec", "get_mscale", "inverse_frequencies", "llama3_scaled", "tables"]


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `scale` (transformers' `get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(pos_freqs: torch.Tensor, dim: int, spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, with its rounding."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(spec.original_max / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    out = 1.0 / (spec.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    factor = spec.attention_factor
    if factor is None:
        if spec.mscale and spec.mscale_all_dim:
            factor = float(get_mscale(spec.factor, spec.mscale) / get_mscale(spec.factor, spec.mscale_all_dim))
        else:
            factor = get_mscale(spec.factor)
    return out, factor


def llama3_scaled(inv: torch.Tensor, factor: float, low: float, high: float, old: int) -> torch.Tensor:
    """Llama 3.1's frequency scaling (`rope_type: llama3`): long wavelengths divided by `factor`, short ones kept,
    and a smooth blend between the two wavelength bounds (`low`/`high` freq factors, `old` context)."""
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,) fp32 on CPU, attention factor) of one table."""
    # transformers computes the exponent as arange(...).float() / dim in fp32: the same rounding here
    pos_freqs = spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / pos_freqs
    if spec.kind == "default":
        return inv, 1.0
    if spec.kind == "linear":
        return inv / spec.factor, 1.0
    if spec.kind == "llama3":
        return llama3_scaled(inv, spec.factor, spec.low_freq_factor, spec.high_freq_factor, spec.original_max), 1.0
    if spec.kind == "yarn":
        return _yarn(pos_freqs, head_dim, spec)
    raise ValueError(f"rope type {spec.kind!r} is not one of default, linear, llama3, yarn")


def tables(positions: torch.Tensor, head_dim: int, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., S, head_dim/2) for `positions`, each times the table's attention factor."""
    inv, factor = inverse_frequencies(spec, head_dim)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv.to(positions.device)
    cos, sin = ang.cos(), ang.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin
