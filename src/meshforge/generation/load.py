"""What `meshforge generate` runs: a plain model with its weights, its tokenizer, context and stop tokens.

Sources:
- a meshforge checkpoint (a run directory, its checkpoints folder, or one `step_N`): verified (sizes, sha256), the
  model the run's config.yaml says (with `model.*` overrides; the manifest's arguments where no config.yaml is
  found) checked against the checkpoint exactly as a resume checks it (`check_same_model`: another model is one
  line), and its tensors read by DCP into the plain model, which reshards from whatever strategy, parallelism and
  world size saved them (as `checkpoint export` consolidates them);
- a Hugging Face folder of a built-in family (an exported model too): config.json read exactly and the safetensors
  imported as `model.init_from` imports them.
The tokenizer is `--tokenizer`, else the one the run recorded (the byte-level one for `data.source: text`), else the
folder's own; the stop tokens are the tokenizer's end-of-sequence token and config.json's `eos_token_id`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from meshforge.checkpoint.hf import _state, hf_model_args, load_hf_into
from meshforge.checkpoint.manifest import MANIFEST, verify_files
from meshforge.checkpoint.paths import resolve_checkpoint_path
from meshforge.checkpoint.peft import refuse_adapter_checkpoint
from meshforge.checkpoint.safe_dcp import dcp_load
from meshforge.checkpoint.verify import check_same_model
from meshforge.config.loader import apply_overrides, read_yaml, resolve
from meshforge.data.tokenizer import ByteTokenizer, load_tokenizer
from meshforge.errors import CheckpointError, ConfigError
from meshforge.models import ModelArgs, build_model, resolve_model_args


@dataclass
class Loaded:
    model: torch.nn.Module  # plain, eval mode, on its device
    args: ModelArgs
    tokenizer: object | None  # data/tokenizer.py's, or None (the source names none)
    where: Path  # the checkpoint or folder read

    @property
    def context(self) -> int:
        """Tokens the model can attend over: its context length; a sliding window the model does not apply itself
        (Mistral's, on the Llama forward) bounds it, being exact within."""
        window = None if getattr(self.model, "applies_windows", False) else self.args.sliding_window
        return min(self.args.max_seq_len, window) if window else self.args.max_seq_len

    def stop_ids(self) -> set[int]:
        eos = self.args.eos_token_id
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None:
            ids.add(self.tokenizer.eos_id)
        return ids


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / MANIFEST).is_file()


def load(source: str, overrides: list[str], tokenizer: str | None, device: torch.device,
         dtype: torch.dtype = torch.float32) -> Loaded:
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{source}: no such file or directory (give a run directory, a checkpoint or a Hugging "
                              "Face model folder)")
    if is_hf_folder(path):
        if overrides:
            raise ConfigError([f"{overrides[0]}: a Hugging Face folder's model is its config.json (overrides are for "
                               "a run's checkpoint)"])
        loaded = _from_hf_folder(path)
    else:
        loaded = _from_checkpoint(path, overrides)
    if tokenizer:
        loaded.tokenizer = load_tokenizer(tokenizer)
    loaded.model.to(device=device, dtype=dtype).eval()
    return loaded


def _from_hf_folder(path: Path) -> Loaded:
    args = hf_model_args(path, what=str(path))
    model = build_model(args)
    load_hf_into(model, path)
    tok = load_tokenizer(str(path)) if (path / "tokenizer.json").is_file() else None
    return Loaded(model, args, tok, path)


def _from_checkpoint(path: Path, overrides: list[str]) -> Loaded:
    ckpt = resolve_checkpoint_path(path)
    if not (ckpt / MANIFEST).is_file():
        raise CheckpointError(f"{path}: not a checkpoint, a run directory with one (LATEST), or a Hugging Face folder "
                              "(config.json)")
    manifest = verify_files(ckpt)
    refuse_adapter_checkpoint(ckpt, manifest)
    if manifest.get("model_args", {}).get("hf_model"):
        raise CheckpointError(f"{ckpt}: a model.hf_model run: export it (`meshforge checkpoint export`) and generate "
                              "from that folder with transformers")
    args = _model_args(path, ckpt, manifest, overrides)
    model = build_model(args)
    state = dict(_state(model))
    check_same_model(ckpt, manifest, state, dataclasses.asdict(args), allow_partial=False)
    dcp_load({"model": state}, ckpt, no_dist=True)  # plain full tensors: any saved sharding reads into them
    return Loaded(model, args, _recorded_tokenizer(manifest.get("tokenizer")), ckpt)


def _model_args(path: Path, ckpt: Path, manifest: dict, overrides: list[str]) -> ModelArgs:
    """The model the run's config.yaml says (with `model.*` overrides), else the checkpoint's own arguments."""
    bad = [o for o in overrides if not o.startswith("model.")]
    if bad:
        raise ConfigError([f"{bad[0]}: only model.* overrides apply to generation"])
    found = [p / "config.yaml" for p in (path, ckpt.parent.parent) if (p / "config.yaml").is_file()]
    if not found:
        if overrides:
            raise ConfigError([f"{overrides[0]}: no config.yaml beside {ckpt} to override"])
        return ModelArgs(**manifest["model_args"])
    raw = {"model": read_yaml(found[0]).get("model") or {}}
    return resolve_model_args(resolve(apply_overrides(raw, overrides), world_size=1).model)


def _recorded_tokenizer(recorded: str | None):
    if recorded is None:
        return None
    if recorded == "bytes":
        return ByteTokenizer()
    return load_tokenizer(recorded)

