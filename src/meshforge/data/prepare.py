"""`meshforge data prepare`: text files -> a byte-level token file (.npy, uint16 or uint32) for
data.source=tokenized."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshforge.data.sources import byte_tokens, expand_paths, stdlib_sources
from meshforge.progress import track


def prepare(inputs: list[str], output: str, dtype: str = "uint16") -> tuple[int, Path]:
    files = expand_paths(inputs) if inputs else stdlib_sources()
    tokens = byte_tokens(track(files, "data prepare: files read")).astype(np.dtype(dtype))
    out = Path(output)
    if out.suffix != ".npy":
        out = out.with_suffix(".npy")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".npy.tmp")
    with open(tmp, "wb") as f:
        np.save(f, tokens, allow_pickle=False)
    tmp.replace(out)
    return len(tokens), out
