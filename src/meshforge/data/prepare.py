"""`meshforge data prepare`: text or record files -> a token file (.npy, uint16 or uint32) for
data.source=tokenized, which memory-maps it (the path for data larger than memory).

Byte-level by default (UTF-8 text only: a binary input is refused, naming it). With `--tokenizer`, inputs
stream through in chunks of documents (a record file's `--text-field`, or a text file's whole text), each
encoded by `tokenizers`' `encode_batch`, which runs on all cores; tokens are appended to the output as they
come, so memory holds one chunk, not the corpus.

The output (`meshforge.outputs`): a new file, or an earlier token file, replaced in one step once the new one
is whole; never one of the inputs, a folder, another kind of file, or a place inside a checkpoints folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

import meshforge.outputs as outputs
from meshforge.data.records import documents
from meshforge.data.sources import byte_tokens, expand_paths, stdlib_sources
from meshforge.errors import DataError
from meshforge.progress import track

CHUNK_DOCS = 1024


def _write_npy(out: Path, chunks: Iterator[np.ndarray], dtype: np.dtype) -> int:
    """Append chunks to a raw file, then write the .npy header in front (one pass over the data on disk), under
    temporary names beside `out`; `out` is replaced only by a whole token file."""
    raw, tmp = outputs.temp_beside(out, ".raw"), outputs.temp_beside(out, ".npy")
    try:
        n = 0
        with open(raw, "wb") as f:
            for c in chunks:
                c.astype(dtype).tofile(f)
                n += len(c)
        if n == 0:
            raise DataError("data prepare: the inputs hold no text")
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
        src = np.memmap(raw, dtype=dtype, mode="r")
        step = 1 << 24
        for i in range(0, n, step):
            arr[i:i + step] = src[i:i + step]
        arr.flush()
        del arr, src
        outputs.publish_file(tmp, out)
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return n


def is_token_file(path: Path) -> bool:
    """A 1-D uint16/uint32 .npy: what `data prepare` writes (and data.source=tokenized reads)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError):
        return False
    return isinstance(arr, np.ndarray) and arr.ndim == 1 and arr.dtype in (np.uint16, np.uint32)


def output_path(output: str, inputs: list[Path]) -> Path:
    """The .npy file `--output` names, or one DataError line saying why meshforge will not write it."""
    out = Path(output)
    if out.name in ("", ".", "..") or out.is_dir():
        raise DataError(f"--output={output} is a folder: give a file name, e.g. {out / 'tokens.npy'}")
    if out.suffix != ".npy":
        out = out.with_suffix(".npy")
    problem = outputs.check_file(out, "--output", is_token_file, "a token file of `meshforge data prepare`",
                                 sources=inputs)
    if problem is not None:
        raise DataError(problem)
    return out


def prepare(inputs: list[str], output: str, dtype: str = "uint16", tokenizer: str | None = None,
            text_field: str = "text") -> tuple[int, Path]:
    files = expand_paths(inputs) if inputs else stdlib_sources()
    out = output_path(output, files)
    out.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(dtype)
    if tokenizer is None:
        return _write_npy(out, iter([byte_tokens(track(files, "data prepare: files read"))]), np_dtype), out

    from meshforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > np.iinfo(np_dtype).max + 1:
        raise DataError(f"data prepare: the tokenizer has {tok.vocab_size} tokens, too many for {dtype}: "
                        "use --dtype uint32")

    def chunks() -> Iterator[np.ndarray]:
        batch: list[str] = []
        for doc in documents(track(files, "data prepare: files tokenized"), text_field):
            batch.append(doc)
            if len(batch) == CHUNK_DOCS:
                yield from _encode(batch)
                batch = []
        if batch:
            yield from _encode(batch)

    def _encode(batch: list[str]) -> Iterator[np.ndarray]:
        yield np.concatenate([np.asarray(ids + [tok.eos_id], dtype=np.int64) for ids in tok.encode_batch(batch)])

    return _write_npy(out, chunks(), np_dtype), out
