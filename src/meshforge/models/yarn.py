"""YaRN RoPE scaling (Peng et al. 2023, transformers' `rope_type: yarn`): its `model.*` fields, its config.json keys,
and the frequencies and attention factor it computes. Torch-free at import (the fields join the schema); the
computation imports torch when called.

YaRN stretches the low frequencies by `factor` (interpolation), keeps the high ones (extrapolation) and blends
linearly between the wavelength bounds set by `beta_fast` / `beta_slow` rotations over the original context; it
also scales cos and sin by an attention factor (`attention_factor`, else derived from `mscale` / `mscale_all_dim`,
else 0.1 ln(factor) + 1). This file follows transformers' `modeling_rope_utils._compute_yarn_parameters` (the
reference the import tests compare against) line for line. A family that reads YaRN declares `YARN_FIELDS` among
its own fields; `factor` and `original_max_position_embeddings` are the shared `model.rope_factor` and
`model.rope_original_max_seq_len`.
"""

from __future__ import annotations

import math

from meshforge.models.family import Arg

YARN_FIELDS: tuple[Arg, ...] = (
    Arg("yarn_beta_fast", float, 32.0, "yarn scaling: beta_fast (rotations where extrapolation ends)", gt=0),
    Arg("yarn_beta_slow", float, 1.0, "yarn scaling: beta_slow (rotations where interpolation starts)", gt=0),
    Arg("yarn_mscale", float | None, None, "yarn scaling: mscale (with yarn_mscale_all_dim: the attention factor)",
        gt=0),
    Arg("yarn_mscale_all_dim", float | None, None, "yarn scaling: mscale_all_dim (also scales the softmax, "
        "DeepSeek)", ge=0),
    Arg("yarn_attention_factor", float | None, None, "yarn scaling: attention_factor (overrides the derived one)",
        gt=0),
    Arg("yarn_truncate", bool, True, "yarn scaling: round the correction range to whole dimensions"),
)

# config.json's rope parameter -> model field, for rope_type yarn (`factor` and the original length are required)
_KEYS = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
         "mscale_all_dim": "yarn_mscale_all_dim", "attention_factor": "yarn_attention_factor",
         "truncate": "yarn_truncate"}


def read_yarn(params: dict, max_positions: int, refuse) -> dict:
    """The yarn keys of a config's rope parameters (consumed from `params`) -> `model.*` values."""
    if params.get("factor") is None:
        refuse("rope_type yarn needs 'factor'")
    out = {"rope_factor": float(params.pop("factor")),
           # transformers defaults the original length to max_position_embeddings
           "rope_original_max_seq_len": int(params.pop("original_max_position_embeddings", None) or max_positions)}
    for theirs, ours in _KEYS.items():
        value = params.pop(theirs, None)
        if value is not None:
            out[ours] = bool(value) if ours == "yarn_truncate" else float(value)
    return out


def write_yarn(a) -> dict:
    """`model.*` yarn values -> config.json rope parameters (besides rope_theta and rope_type)."""
    out = {"factor": a.rope_factor, "original_max_position_embeddings": a.rope_original_max_seq_len}
    for theirs, ours in _KEYS.items():
        value = getattr(a, ours)
        if value is not None:
            out[theirs] = value
    return out


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(a) -> float:
    """The factor cos and sin are multiplied by."""
    if a.yarn_attention_factor is not None:
        return a.yarn_attention_factor
    if a.yarn_mscale and a.yarn_mscale_all_dim:
        return get_mscale(a.rope_factor, a.yarn_mscale) / get_mscale(a.rope_factor, a.yarn_mscale_all_dim)
    return get_mscale(a.rope_factor)


def yarn_inv_freq(a, dim: int):
    """The (dim/2,) fp32 inverse frequencies of YaRN for a rotary dimension `dim`."""
    import torch

    base, factor = a.rope_theta, a.rope_factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(a.rope_original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(a.yarn_beta_fast), correction_dim(a.yarn_beta_slow)
    if a.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies, kept), 0: interpolate (low frequencies, stretched)
    return interpolation * (1 - keep) + extrapolation * keep
