"""YaRN RoPE scaling's `model.*` fields and config.json keys (transformers' `rope_type: yarn`); torch-free (the
fields join the schema). models/rope.py computes the table (frequencies and attention factor) from them.

`factor` and `original_max_position_embeddings` are the shared `model.rope_factor` and
`model.rope_original_max_seq_len`; the other keys are a family's own fields: one that reads YaRN declares
`YARN_FIELDS` (DeepSeek-V3: all of them) or the ones it honours (GPT-OSS: `YARN_RAMP_FIELDS`; the mscale keys,
DeepSeek's attention factor, are then refused by name).
"""

from __future__ import annotations

from collections.abc import Callable

from meshforge.models.family import Arg

YARN_RAMP_FIELDS: tuple[Arg, ...] = (
    Arg("yarn_beta_fast", float, 32.0, "yarn scaling: beta_fast (rotations where extrapolation ends)", gt=0),
    Arg("yarn_beta_slow", float, 1.0, "yarn scaling: beta_slow (rotations where interpolation starts)", gt=0),
    Arg("yarn_attention_factor", float | None, None, "yarn scaling: attention_factor (overrides the derived one)",
        gt=0),
    Arg("yarn_truncate", bool, True, "yarn scaling: round the correction range to whole dimensions"),
)
YARN_FIELDS: tuple[Arg, ...] = YARN_RAMP_FIELDS + (
    Arg("yarn_mscale", float | None, None, "yarn scaling: mscale (with yarn_mscale_all_dim: the attention factor)",
        gt=0),
    Arg("yarn_mscale_all_dim", float | None, None, "yarn scaling: mscale_all_dim (also scales the softmax, "
        "DeepSeek)", ge=0),
)

# config.json's rope parameter -> model field, for rope_type yarn (`factor` and the original length are required)
_KEYS = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
         "mscale_all_dim": "yarn_mscale_all_dim", "attention_factor": "yarn_attention_factor",
         "truncate": "yarn_truncate"}


def read_yarn(params: dict, max_positions: int, refuse: Callable[[str], None],
              fields: tuple[Arg, ...] = YARN_FIELDS) -> dict:
    """The yarn keys of a config's rope parameters (consumed from `params`) -> `model.*` values. Keys of fields not
    in `fields` (those the family does not honour) stay in `params`, for the caller to refuse by name."""
    if params.get("factor") is None:
        refuse("rope_type yarn needs 'factor'")
    out = {"rope_factor": float(params.pop("factor")),
           # transformers defaults the original length to max_position_embeddings
           "rope_original_max_seq_len": int(params.pop("original_max_position_embeddings", None) or max_positions)}
    honoured = {a.name for a in fields}
    for theirs, ours in _KEYS.items():
        if ours not in honoured or theirs not in params:
            continue
        value = params.pop(theirs)
        if value is not None:
            out[ours] = bool(value) if ours == "yarn_truncate" else float(value)
    if out.get("yarn_beta_fast") == 0 or out.get("yarn_beta_slow") == 0:
        refuse("beta_fast/beta_slow 0 (transformers reads them as unset): give them or leave them out")
    return out


def write_yarn(a) -> dict:
    """`model.*` yarn values -> config.json rope parameters (besides rope_theta and rope_type)."""
    out = {"factor": a.rope_factor, "original_max_position_embeddings": a.rope_original_max_seq_len}
    for theirs, ours in _KEYS.items():
        value = getattr(a, ours)
        if value is not None:
            out[theirs] = value
    return out
