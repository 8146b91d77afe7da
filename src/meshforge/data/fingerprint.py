"""What a resume checks the data against: a fingerprint of every input a data source reads.

A fingerprint is {label: entry}: one entry per input file (`data.paths` and `data.path`, every file of a saved
dataset folder, the tokenizer's files, the validation files) and one for the settings that shape the samples
(source kind, seq_len, format, ...). A file's entry is its size and a SHA-256:
- of the whole file when it holds at most `FULL_HASH_BYTES` (64 MiB): any change is seen;
- above that, of `SAMPLE_BLOCKS` blocks of `BLOCK_BYTES` spread evenly across the file (the first and the last
  included; 4 MiB read per file), together with the file's modification time: a change of size, of
  modification time or inside a sampled block is seen. An edit that keeps the size and the modification time
  and misses every block is not; a copy that does not keep modification times (`cp` without `-p`) reads as
  changed.
The loader keeps the fingerprint in its checkpointed state; `check_resume` refuses a resume whose fingerprint
differs with one line naming the first changed input, unless `checkpoint.allow_changed_inputs=true`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from meshforge.errors import DataError

FULL_HASH_BYTES = 64 << 20
SAMPLE_BLOCKS = 64
BLOCK_BYTES = 64 << 10
ALLOW_KEY = "checkpoint.allow_changed_inputs"


def file_entry(path: Path) -> str:
    """`bytes=N sha256=H` (whole file) or `bytes=N mtime_ns=T sampled_sha256=H` (large file)."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if st.st_size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return f"bytes={st.st_size} sha256={h.hexdigest()[:32]}"
        last = st.st_size - BLOCK_BYTES
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(BLOCK_BYTES))
    return f"bytes={st.st_size} mtime_ns={st.st_mtime_ns} sampled_sha256={h.hexdigest()[:32]}"


def files(label: str, paths: Iterable[str | Path]) -> dict[str, str]:
    """{`label: path`: entry} for each file; a folder contributes every file under it. A file that cannot be
    read is one DataError line naming it."""
    out = {}
    for p in map(Path, paths):
        for f in sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]:
            try:
                out[f"{label}: {f}"] = file_entry(f)
            except OSError as err:
                raise DataError(f"{label}: {f} cannot be read ({err.strerror or type(err).__name__})") from None
    return out


def settings(**values) -> dict[str, str]:
    """The entry for what shapes the samples besides the files."""
    return {"data settings": " ".join(f"{k}={v}" for k, v in values.items())}


def digest(inputs: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(inputs.items())).encode()).hexdigest()[:16]


def _fields(entry: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in entry.split())


def differences(saved: dict, mine: dict[str, str]) -> list[str]:
    """One phrase per input that differs between a saved fingerprint and this run's: files first (a changed file is
    the cause of a changed settings or examples entry), then the rest."""
    out = []
    for label in sorted(set(saved) | set(mine), key=lambda k: (": " not in k, k)):
        was, now = saved.get(label), mine.get(label)
        if was == now:
            continue
        if now is None:
            out.append(f"{label} was read by the checkpointed run but not by this one")
        elif was is None:
            out.append(f"{label} is read by this run but was not by the checkpointed one")
        elif label == "data settings":
            out.append(f"the data settings changed ({was} -> {now})")
        else:
            a, b = _fields(str(was)), _fields(now)
            what = (f"size {a.get('bytes')} -> {b.get('bytes')} bytes" if a.get("bytes") != b.get("bytes") else
                    "modification time" if a.get("mtime_ns") != b.get("mtime_ns") else "content")
            out.append(f"{label} changed since the checkpoint ({what})")
    return out


def check_resume(state: dict, inputs: dict[str, str], allow: bool) -> str | None:
    """Compare a loader state's fingerprint with this run's: None when equal; a warning line when they differ and
    `allow`; else ValueError with one line naming the first difference. A state without one (a bare position)
    is not checked."""
    if "source" not in state or state["source"] == digest(inputs):
        return None
    saved = state.get("inputs")
    if isinstance(saved, dict):
        diffs = differences(saved, inputs) or ["the data fingerprint differs"]
    else:  # a checkpoint from before inputs were fingerprinted file by file: nothing to compare with
        diffs = ["the checkpoint's data fingerprint is of an older kind and cannot be compared with this run's"]
    what = diffs[0] + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")
    if not allow:
        raise ValueError(f"{what}: resume with the data it was trained on, or set {ALLOW_KEY}=true to resume on "
                         "the changed data")
    return f"warning: resuming on changed data, {ALLOW_KEY}=true: {what}"
