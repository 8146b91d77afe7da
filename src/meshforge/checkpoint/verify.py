"""Is this checkpoint this model's? Its tensor names and shapes and its stored model arguments, checked before
anything is loaded; a difference is one line naming the parameter or the argument, or, with
`checkpoint.allow_partial_load`, the set of tensors both have (their shapes must still match).

And did the model start from the same files? The manifest records `model_inputs`: the content fingerprint
(`data/fingerprint.py`: full SHA-256 up to 64 MiB a file, sampled blocks above) of the folders the model was
built from: `model.init_from` (config.json and the safetensors: a LoRA run's frozen base) and `peft.init_from`
(the PEFT adapter files). A resume from the same folder whose files changed is refused naming the file, unless
`checkpoint.allow_changed_inputs=true`; `export --merge` refuses a changed base outright.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from meshforge.checkpoint.collectives import all_gather_object
from meshforge.checkpoint.safe_dcp import dcp_tensor_shapes
from meshforge.data import fingerprint
from meshforge.errors import CheckpointError, DataError
from meshforge.models import ModelArgs

# the files of a folder a model starts from, by its setting (what `load_hf_into` / `load_peft_adapter` read)
_MODEL_FILES = {"model.init_from": ("config.json", "model.safetensors.index.json", "*.safetensors"),
                "peft.init_from": ("adapter_config.json", "adapter_model.safetensors")}


def folder_inputs(key: str, folder: str | Path) -> dict:
    """{"folder": absolute path, "files": {"<key>: <file>": fingerprint entry}} of the files `key` reads there."""
    root = Path(folder).expanduser().resolve()
    names = sorted({p for pattern in _MODEL_FILES[key] for p in root.glob(pattern) if p.is_file()})
    try:
        return {"folder": str(root), "files": fingerprint.files(key, names)}
    except DataError as err:
        raise CheckpointError(str(err)) from None


def model_inputs(cfg) -> dict[str, dict]:
    """The `model_inputs` manifest entry of a run: {setting: `folder_inputs`} for model.init_from and
    peft.init_from where set."""
    folders = {"model.init_from": cfg.model.init_from,
               "peft.init_from": cfg.peft.init_from if cfg.peft is not None else None}
    return {key: folder_inputs(key, folder) for key, folder in folders.items() if folder}


def changed_inputs(saved, mine: dict[str, dict]) -> str | None:
    """The first difference between a checkpoint's `model_inputs` and `mine` (and how many more), setting by
    setting where both read the same folder (another folder is another start: the LoRA base's own check refuses
    that); None when none (or the checkpoint predates model-input fingerprints)."""
    if not isinstance(saved, dict):
        return None
    diffs = []
    for key, now in mine.items():
        was = saved.get(key)
        if isinstance(was, dict) and was.get("folder") == now["folder"] and isinstance(was.get("files"), dict):
            diffs += fingerprint.differences(was["files"], now["files"])
    return diffs[0] + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "") if diffs else None


def check_model_inputs(path: Path, saved, mine: dict[str, dict], allow: bool) -> str | None:
    """`changed_inputs` on resume: None when equal; a warning line when they differ and `allow`; else one
    CheckpointError line naming the first changed file."""
    what = changed_inputs(saved, mine)
    if what is None:
        return None
    if not allow:
        raise CheckpointError(f"{path}: {what}: the model started from other files; restore them, or set "
                              f"{fingerprint.ALLOW_KEY}=true to resume on the changed ones")
    return f"warning: resuming on changed model inputs, {fingerprint.ALLOW_KEY}=true: {what}"


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
