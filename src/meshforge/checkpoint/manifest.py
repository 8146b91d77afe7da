"""A checkpoint's manifest: what it records about the run and every file's size and sha256, and the check of a
checkpoint's files against it.

`manifest.json` is written last, by rank 0, once every rank's files are on disk (`manager.py`): its presence
marks a checkpoint complete. Beside `files` ({name: {bytes, sha256}}) it records the step, `contents` (the
parts saved: "model" or "adapter", "optim", "trainer_state"), the format, strategy, world size and layout,
`config_digest`, `model_args` (a resume checks them), and what the parts add (`parts.py`: the LoRA settings,
the export's tokenizer and config.json). `verify_files` splits the hashing among the ranks and fails with one
line naming the file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path

import torch

from meshforge.checkpoint.collectives import all_gather_object, rank, world
from meshforge.config.schema import BRIDGE_SECTIONS
from meshforge.errors import CheckpointError
from meshforge.models import resolve_model_args

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def config_digest(cfg) -> str:
    d = cfg.model_dump(mode="json", exclude=BRIDGE_SECTIONS)
    d.get("checkpoint", {}).pop("resume", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def model_args_dict(cfg) -> dict:
    return dataclasses.asdict(resolve_model_args(cfg.model))


def file_entry(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def verify_files(path: Path, manifest: dict | None = None, group=None) -> dict:
    """Check every file of the manifest (hashing split among the ranks); the manifest, or a one-line error."""
    path = Path(path)
    mpath = path / MANIFEST
    if manifest is None:
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint directory")
        if not mpath.is_file():
            raise CheckpointError(f"{mpath}: missing (not a complete meshforge checkpoint)")
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{mpath}: unreadable manifest ({type(err).__name__}: {err})") from None
    files = manifest["files"]
    names = sorted(files)
    problems = []
    for name in names[rank()::world()]:
        f, want = path / name, files[name]
        if not f.is_file():
            problems.append(f"{f}: missing (listed in {MANIFEST})")
            continue
        size = f.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{f}: truncated or altered ({size} bytes, {MANIFEST} says {want['bytes']})")
            continue
        got = file_entry(f)["sha256"]
        if got != want["sha256"]:
            problems.append(f"{f}: checksum mismatch (sha256 {got[:16]}..., {MANIFEST} says {want['sha256'][:16]}...)")
    allp = sorted(p for ps in all_gather_object(problems, group) for p in ps)
    if allp:
        more = f" (and {len(allp) - 1} more problems)" if len(allp) > 1 else ""
        raise CheckpointError(allp[0] + more)
    return manifest


def new_manifest(**fields) -> dict:
    """A manifest of `fields` (step, contents, files, ...), stamped with the format version, torch's version and
    the time of writing."""
    return {"format_version": FORMAT_VERSION, **fields, "torch_version": torch.__version__,
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
