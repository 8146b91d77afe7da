"""The model to evaluate, on one process: from a meshforge checkpoint (a run dir, its checkpoints dir or one
step) or from a Hugging Face folder. A checkpoint's weights are read as `checkpoint export` reads them (DCP,
any strategy and world size it was saved with, no process group); a folder's through `load_hf_into` (its
config.json must describe a meshforge model family, every tensor honoured). The tokenizer is the run's (the
manifest records it) or the folder's tokenizer.json; `--tokenizer` replaces either."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from meshforge.data.tokenizer import ByteTokenizer, load_tokenizer
from meshforge.errors import CheckpointError, DataError
from meshforge.models import ModelArgs, build_model


@dataclass
class EvalModel:
    model: torch.nn.Module
    args: ModelArgs
    tokenizer: object  # data.tokenizer's kind: encode, eos_id, vocab_size
    tokenizer_path: str | None  # what data.tokenizer would say (None: byte-level)
    where: str


def load_eval_model(source: str, tokenizer: str | None = None, device: str = "cpu") -> EvalModel:
    from meshforge.checkpoint.hf import hf_model_args, load_hf_into
    from meshforge.checkpoint.manifest import MANIFEST, verify_files
    from meshforge.checkpoint.paths import resolve_checkpoint_path

    p = Path(source)
    if not p.exists():
        raise CheckpointError(f"eval: {source} does not exist (a run directory, a checkpoint or a Hugging Face "
                              "folder)")
    if (p / "config.json").is_file() and not (p / MANIFEST).is_file():  # a Hugging Face folder
        args = hf_model_args(p, "eval")
        model = build_model(args)
        load_hf_into(model, p)
        tok_path = tokenizer or (str(p) if (p / "tokenizer.json").is_file() else None)
    else:
        ckpt = resolve_checkpoint_path(p)
        if not (ckpt / MANIFEST).is_file():
            raise CheckpointError(f"eval: {source} holds no checkpoint (no {MANIFEST}) and no config.json")
        manifest = verify_files(ckpt)  # every file's size and sha256 first, as export does
        values = manifest.get("model_args") or {}
        lora = "adapter" in manifest.get("contents", [])
        if values.get("hf_model") or lora:
            raise CheckpointError(f"eval: {ckpt} is a {'LoRA' if lora else 'model.hf_model'} checkpoint: export it "
                                  f"(`meshforge checkpoint export{' --merge' if lora else ''}`) and evaluate the "
                                  "folder")
        args = ModelArgs(**values)
        model = _load_checkpoint(args, ckpt)
        recorded = manifest.get("tokenizer")
        tok_path = tokenizer or (None if recorded in (None, "bytes") else recorded)
        if tokenizer is None and recorded is None:
            raise DataError(f"eval: the checkpoint {ckpt} records no tokenizer: give --tokenizer")
    tok = load_tokenizer(tok_path) if tok_path else ByteTokenizer()
    if tok.vocab_size > args.vocab_size:
        raise DataError(f"eval: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                        f"{args.vocab_size}: give the tokenizer it was trained with (--tokenizer)")
    model.to(device).eval()
    return EvalModel(model, args, tok, tok_path, str(p))


def _load_checkpoint(args: ModelArgs, ckpt: Path) -> torch.nn.Module:
    from meshforge.checkpoint.safe_dcp import dcp_load, dcp_tensor_shapes

    model = build_model(args)
    state = {f"model.{n}": t for n, t in model.state_dict().items()}
    shapes = dcp_tensor_shapes(ckpt)
    missing = [k for k in state if k not in shapes]
    if missing:
        raise CheckpointError(f"eval: {ckpt}: {missing[0]} is missing from the checkpoint")
    wanted = {k: torch.empty(shapes[k][0], dtype=shapes[k][1]) for k in state}  # as saved (fp32 or bf16)
    dcp_load(wanted, ckpt, no_dist=True)
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(wanted[k])
    return model
