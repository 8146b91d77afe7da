"""Is this checkpoint this model's? Its tensor names and shapes and its stored model arguments, checked before
anything is loaded; a difference is one line naming the parameter or the argument, or, with
`checkpoint.allow_partial_load`, the set of tensors both have (their shapes must still match).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from meshforge.checkpoint.collectives import all_gather_object
from meshforge.checkpoint.safe_dcp import dcp_tensor_shapes
from meshforge.errors import CheckpointError
from meshforge.models import ModelArgs


def _names(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_model_keys(path: Path, mine: dict[str, tuple[int, ...]], allow_partial: bool) -> set[str] | None:
    """None when the checkpoint's `model.*` tensors are exactly this model's (`mine`: every name of the whole
    model with its full shape); else a one-line CheckpointError, or with `allow_partial`
    (checkpoint.allow_partial_load) the names both have (their shapes must still match)."""
    saved = {k.removeprefix("model."): v for k, v in dcp_tensor_shapes(path).items() if k.startswith("model.")}
    for fqn in sorted(set(saved) & set(mine)):
        if saved[fqn][0] != mine[fqn]:
            raise CheckpointError(f"{path}: parameter {fqn} has shape {saved[fqn][0]} in the checkpoint but "
                                  f"{mine[fqn]} in this model (model.* differs from the run that saved it)")
    missing, extra = set(mine) - set(saved), set(saved) - set(mine)
    if (missing or extra) and not allow_partial:
        parts = ([f"missing from the checkpoint: {_names(missing)}"] if missing else []) + \
                ([f"in the checkpoint but not in this model: {_names(extra)}"] if extra else [])
        raise CheckpointError(f"{path}: saved from another model ({'; '.join(parts)}); set "
                              "checkpoint.allow_partial_load=true to load only the tensors both have")
    return set(mine) & set(saved) if missing or extra else None


def check_same_model(path: Path, manifest: dict, model_state: dict, model_args: dict,
                     allow_partial: bool) -> set[str] | None:
    """Refuse a checkpoint of another model: its exact set of tensor names and shapes, and its stored model
    arguments, must be this model's (`model_state`: this rank's part of the model, as it loads; `model_args`:
    this run's). With `allow_partial` and another model: the names this rank loads (shapes must still match).
    Every rank calls it (a pipeline rank holds only its stages: the model is every rank's parts)."""
    mine = {fqn: tuple(t.shape) for fqn, t in model_state.items()}  # full shapes (DTensors say them)
    mine = {k: v for ranks in all_gather_object(mine) for k, v in ranks.items()}
    keys = check_model_keys(path, mine, allow_partial)
    keys = None if keys is None else keys & set(model_state)  # what this rank loads
    saved, mine = manifest.get("model_args"), json.loads(json.dumps(model_args))  # as stored
    if isinstance(saved, dict):  # a field added since the checkpoint was saved had its default value then
        saved = {**json.loads(json.dumps(dataclasses.asdict(ModelArgs()))), **saved}
    diff = [f"{k}={saved.get(k)!r} (this model {mine.get(k)!r})" for k in sorted(set(saved) | set(mine))
            if saved.get(k) != mine.get(k)] if isinstance(saved, dict) else []
    if diff and not allow_partial:
        raise CheckpointError(f"{path}: saved from another model: {', '.join(diff[:6])}"
                              f"{f' and {len(diff) - 6} more' if len(diff) > 6 else ''}; set model.* to "
                              "match, or checkpoint.allow_partial_load=true to load the tensors both have")
    if keys is None and diff:  # same tensors, other model args (e.g. rope_theta): still another model
        keys = set(model_state)
    return keys
