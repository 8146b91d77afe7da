"""The model to evaluate, on one process: from a meshforge checkpoint (a run dir, its checkpoints dir or one
step) or from a Hugging Face folder, loaded as `meshforge generate` loads it (generation/load.py: a checkpoint
of any strategy and world size into plain tensors, no process group; a folder's config.json describing a meshforge
model family, every tensor honoured). The tokenizer is the run's (the manifest records it) or the folder's
tokenizer.json; `--tokenizer` replaces either."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from meshforge.data.tokenizer import ByteTokenizer
from meshforge.errors import CheckpointError, DataError
from meshforge.models import ModelArgs


@dataclass
class EvalModel:
    model: torch.nn.Module
    args: ModelArgs
    tokenizer: object  # data.tokenizer's kind: encode, eos_id, vocab_size
    tokenizer_path: str | None  # what data.tokenizer would say (None: byte-level)
    where: str


def load_eval_model(source: str, tokenizer: str | None = None, device: str = "cpu") -> EvalModel:
    from meshforge.checkpoint.manifest import read_manifest
    from meshforge.generation.load import is_hf_folder, load

    p = Path(source)
    if not p.exists():
        raise CheckpointError(f"eval: {source} does not exist (a run directory, a checkpoint or a Hugging Face "
                              "folder)")
    loaded = load(source, [], tokenizer, torch.device(device))  # what `meshforge generate` reads, the same way
    if tokenizer:
        tok_path = tokenizer
    elif is_hf_folder(p):
        tok_path = str(p) if (p / "tokenizer.json").is_file() else None
    else:
        recorded = read_manifest(loaded.where).get("tokenizer")
        if recorded is None:
            raise DataError(f"eval: the checkpoint {loaded.where} records no tokenizer: give --tokenizer")
        tok_path = None if recorded == "bytes" else recorded
    tok = loaded.tokenizer or ByteTokenizer()
    if tok.vocab_size > loaded.args.vocab_size:
        raise DataError(f"eval: the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                        f"{loaded.args.vocab_size}: give the tokenizer it was trained with (--tokenizer)")
    return EvalModel(loaded.model, loaded.args, tok, tok_path, str(p))
