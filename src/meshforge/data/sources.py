"""Token sources: synthetic, byte-level text, and pre-tokenized memory-mapped files.

A source is a random-access sequence of fixed-length samples: `sample(i)` returns
`seq_len + 1` token ids (input and the shifted label). Text and tokenized sources
cut their token stream into non-overlapping windows; synthetic samples are a pure
function of (seed, i), so any rank can produce any sample without coordination.
Every source carries `inputs`, the fingerprint of everything it read (`fingerprint.py`: each file, the
tokenizer, the settings; validation files join the training source's), and `digest()` of it: what the loader
saves and a resume compares.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from meshforge.data import fingerprint
from meshforge.errors import DataError


def stdlib_sources(max_files: int | None = None) -> list[Path]:
    """The Python standard library's own top-level .py files: present on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    return files[:max_files] if max_files else files


def expand_paths(patterns: list[str], folders: bool = False) -> list[Path]:
    """Files matched by globs (a pattern matching nothing is an error); with `folders`, matched folders too (a
    `datasets` save_to_disk folder, for data.source=dataset)."""
    files: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True))
        if not hits:
            raise DataError(f"data.paths: {pat!r} matches no file")
        files += [Path(h) for h in hits if folders or Path(h).is_file()]
    return files


def byte_tokens(files: list[Path]) -> np.ndarray:
    """Byte-level tokenization: each byte is one token (vocab 256); files are joined by a NUL byte. Only UTF-8
    text is read (`records.text_bytes`): a binary file is refused, naming it."""
    from meshforge.data.records import text_bytes

    chunks = []
    for f in files:
        chunks.append(np.frombuffer(text_bytes(f), dtype=np.uint8))
        chunks.append(np.zeros(1, dtype=np.uint8))
    if not chunks:
        raise DataError("data: no text files to read")
    return np.concatenate(chunks)


class TokenStreamSource:
    """Non-overlapping windows of `seq_len + 1` tokens over one token array (in memory or memory-mapped).
    `inputs`: the fingerprint of the files the tokens came from (default: a hash of every token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str, inputs: dict[str, str] | None = None):
        self.tokens, self.seq_len, self.name = tokens, seq_len, name
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(f"data: {name} holds {len(tokens)} tokens, fewer than one sequence of "
                            f"training.seq_len+1 = {seq_len + 1}")
        if inputs is None:
            h = hashlib.sha256(np.ascontiguousarray(tokens).view(np.uint8))
            inputs = {f"tokens: {name}": f"n={len(tokens)} sha256={h.hexdigest()[:32]}",
                      **fingerprint.settings(seq_len=seq_len)}
        self.inputs = inputs

    def sample(self, i: int) -> np.ndarray:
        s = (i % self.num_samples) * self.seq_len
        return np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64)

    def samples(self, indices: list[int]) -> np.ndarray:
        return np.stack([self.sample(i) for i in indices])

    def max_token(self) -> int:
        return int(self.tokens.max())

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)


class SyntheticSource:
    """Uniform random tokens, a pure function of (seed, index); endless."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = 2**40
        self.name = "synthetic"
        self.inputs = fingerprint.settings(source="synthetic", vocab_size=vocab_size, seq_len=seq_len, seed=seed)

    def sample(self, i: int) -> np.ndarray:
        return self.samples([i])[0]

    def samples(self, indices: list[int]) -> np.ndarray:
        # splitmix64 of a per-token counter: a pure function of (seed, i, position), vectorised over the whole
        # batch. A numpy Generator per sample cost ~2% of a tiny model's step (`meshforge bench --baseline`).
        n = self.seq_len + 1
        idx = np.asarray(indices, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            z = (np.uint64(self.seed) * np.uint64(0x9E3779B97F4A7C15)
                 + idx * np.uint64(n) + np.arange(n, dtype=np.uint64)[None, :] + np.uint64(1))
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
        return (z % np.uint64(self.vocab_size)).astype(np.int64)

    def max_token(self) -> int:
        return self.vocab_size - 1

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)


def load_token_file(path: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.path: {path!r} does not exist (make one with `meshforge data prepare`)")
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"data.path: {path!r} is not a .npy token file ({err})") from None
    if arr.dtype not in (np.uint16, np.uint32) or arr.ndim != 1:
        raise DataError(f"data.path: {path!r} holds {arr.dtype} of shape {arr.shape}; expected a 1-D uint16 or "
                        "uint32 token array")
    return arr


def text_tokens(docs: Iterator[str], tokenizer) -> np.ndarray:
    """Each document through the tokenizer, ended by the tokenizer's end-of-sequence token, as one token stream."""
    ids: list[int] = []
    for text in docs:
        ids += tokenizer.encode(text) + [tokenizer.eos_id]
    if not ids:
        raise DataError("data: no text files to read")
    return np.asarray(ids, dtype=np.int64)


def record_paths(paths: list[Path]) -> list[Path]:
    """data.source=dataset reads record files and saved dataset folders only (a text file is data.source=text)."""
    from meshforge.data.records import RECORD_SUFFIXES

    for p in paths:
        if not (p.is_dir() or p.suffix in RECORD_SUFFIXES):
            raise DataError(f"data.paths: {p} has an unknown extension; data.source=dataset reads "
                            f"{', '.join(RECORD_SUFFIXES)} files and `datasets` save_to_disk folders")
    return paths


def build_source(data_cfg, seq_len: int, vocab_size: int, seed: int):
    from meshforge.data.records import documents
    from meshforge.data.tokenizer import check_vocab, load_tokenizer

    if data_cfg.mix:  # several sources blended by weight (data/mix.py)
        return build_mix(data_cfg, seq_len, vocab_size, seed)
    if data_cfg.source == "synthetic":
        return SyntheticSource(vocab_size, seq_len, seed)
    tok = load_tokenizer(data_cfg.tokenizer)
    if data_cfg.tokenizer:  # byte-level data and token files are checked by the ids they hold, below
        check_vocab(tok, vocab_size)
    if data_cfg.source == "tokenized":
        tokens = load_token_file(data_cfg.path)
        inputs = {**fingerprint.files("data.path", [data_cfg.path]),
                  **fingerprint.settings(source="tokenized", seq_len=seq_len)}
        src = TokenStreamSource(tokens, seq_len, data_cfg.path, inputs)
    elif data_cfg.source == "dataset":
        paths = record_paths(expand_paths(data_cfg.paths, folders=True))
        if data_cfg.streaming:  # read and tokenized while training (data/streaming.py)
            from meshforge.data.streaming import StreamingTextSource

            return StreamingTextSource(paths, tok, data_cfg.text_field, seq_len, vocab_size)
        if data_cfg.format == "text":
            name = f"{tok.name}:" + ",".join(data_cfg.paths)
            inputs = {**fingerprint.files("data.paths", paths), **tok.fingerprint(),
                      **fingerprint.settings(source="dataset", text_field=data_cfg.text_field, seq_len=seq_len)}
            src = TokenStreamSource(text_tokens(documents(paths, data_cfg.text_field), tok), seq_len, name, inputs)
        else:
            from meshforge.data.examples import ExampleSource

            src = ExampleSource(paths, data_cfg.format, tok, seq_len, data_cfg.loss_on, data_cfg.too_long,
                                data_cfg.packing)
    else:
        files = expand_paths(data_cfg.paths) if data_cfg.paths else stdlib_sources(data_cfg.max_files)
        if data_cfg.max_files:
            files = files[:data_cfg.max_files]
        name = ",".join(data_cfg.paths) if data_cfg.paths else "python-stdlib"
        inputs = {**fingerprint.files("data.paths", files), **tok.fingerprint(),
                  **fingerprint.settings(source="text", seq_len=seq_len)}
        if data_cfg.tokenizer:
            src = TokenStreamSource(text_tokens(documents(files), tok), seq_len, f"{tok.name}:{name}", inputs)
        else:
            src = TokenStreamSource(byte_tokens(files), seq_len, name, inputs)
    if src.max_token() >= vocab_size:
        raise DataError(f"data: token id {src.max_token()} in {src.name} is outside model.vocab_size={vocab_size}")
    return src


def build_mix(data_cfg, seq_len: int, vocab_size: int, seed: int):
    """Every source of `data.mix` read as the single-source path reads it (its own validation split included);
    a problem with one is one line naming it."""
    names, sources, validation = data_cfg.mix_names(), [], {}
    for i, name in enumerate(names):
        cfg, own_seed = data_cfg.source_config(i), (seed + i) % 2**64  # (synthetic sources: their own tokens)
        try:
            src, val = split_validation(cfg, build_source(cfg, seq_len, vocab_size, own_seed), seq_len,
                                        vocab_size, own_seed)
        except DataError as err:
            raise DataError([f"data.mix[{i}] ({name}): {p.removeprefix('data: ')}" for p in err.problems]) \
                from None
        sources.append(src)
        if val is not None:
            validation[name] = val
    from meshforge.data.mix import MixedSource

    return MixedSource(names, [m.weight for m in data_cfg.mix], sources, validation)


class SubsetSource:
    """The samples `indices` of another source (a held-out split, or what remains for training)."""

    def __init__(self, source, indices: np.ndarray, tag: str):
        self.source, self.indices, self.tag = source, np.asarray(indices, dtype=np.int64), tag
        self.num_samples, self.seq_len = len(self.indices), source.seq_len
        self.name = f"{source.name}[{tag}]"
        split = hashlib.sha256(self.indices.tobytes()).hexdigest()[:32]
        self.inputs = {**source.inputs, "data split": f"{tag} samples={self.num_samples} sha256={split}"}
        self.report = getattr(source, "report", None)  # what the whole source left out (SFT examples)
        self.packing = getattr(source, "packing", False)
        if hasattr(source, "batch"):
            self.batch = self._batch  # a method, not a lambda: the source pickles (spawned data workers)

    def _batch(self, idx):
        return self.source.batch(self._map(idx))

    def _map(self, idx) -> list[int]:
        return [int(self.indices[i % self.num_samples]) for i in idx]

    def samples(self, idx) -> np.ndarray:
        return self.source.samples(self._map(idx))

    def max_token(self) -> int:
        return self.source.max_token()

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)


SPLIT_SEED = 0x5EED  # the held-out split is a property of the data, the same for every run.seed


def split_validation(data_cfg, source, seq_len: int, vocab_size: int, seed: int):
    """(training source, validation source or None) for data.validation: held-out `fraction` of the samples
    (a fixed random split), or `paths` read like the training data."""
    if getattr(source, "mixed", False):  # each source of the mix was split as it was read: {name: validation}
        return source, source.validation or None
    val = data_cfg.validation
    if val is None:
        return source, None
    if val.fraction is not None:
        n = source.num_samples
        k = max(1, round(val.fraction * n))
        if k >= n:
            raise DataError(f"data.validation.fraction={val.fraction} of {n} samples leaves none to train on")
        perm = np.random.default_rng(SPLIT_SEED).permutation(n)
        return (SubsetSource(source, np.sort(perm[k:]), f"train-{val.fraction}"),
                SubsetSource(source, np.sort(perm[:k]), f"validation-{val.fraction}"))
    if data_cfg.source == "tokenized":
        vcfg = data_cfg.model_copy(update={"path": val.paths[0], "validation": None})
    else:
        vcfg = data_cfg.model_copy(update={"paths": list(val.paths), "validation": None, "max_files": None,
                                           "streaming": False})  # validation batches are read in memory
    val_source = build_source(vcfg, seq_len, vocab_size, seed)
    # a resume checks the validation files too: they join the fingerprint the training loader saves
    source.inputs = {**source.inputs, **{f"validation {k}": v for k, v in val_source.inputs.items()}}
    return source, val_source


def batch_loader(source, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 allow_changed_inputs: bool = False):
    """The loader of `source`: random access (`ShardedBatchLoader`, seeded shuffle) or a stream, in order.
    `allow_changed_inputs` (checkpoint.allow_changed_inputs): a resume onto changed data warns instead of failing."""
    from meshforge.data.loader import ShardedBatchLoader

    if getattr(source, "mixed", False):
        from meshforge.data.mix import MixedBatchLoader

        return MixedBatchLoader(source, global_batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                seed=seed, allow_changed_inputs=allow_changed_inputs)
    if getattr(source, "streaming", False):
        from meshforge.data.streaming import StreamingBatchLoader

        return StreamingBatchLoader(source, global_batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                    allow_changed_inputs=allow_changed_inputs)
    return ShardedBatchLoader(source, global_batch_size, micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                              seed=seed, allow_changed_inputs=allow_changed_inputs)
