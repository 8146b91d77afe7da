"""A checkpoint's manifest: what it records about the run and every file's size and sha256, and the check of a
checkpoint's files against it.

`manifest.json` is written last, by rank 0, once every rank's files are on disk (`manager.py`): its presence
marks a checkpoint complete. Beside `files` ({name: {bytes, sha256}}) it records the step, `contents` (the
parts saved: "model" or "adapter", "optim", "trainer_state"), the format, strategy, world size and layout,
`config_digest`, `model_args` (a resume checks them), and what the parts add (`parts.py`: the LoRA settings,
the export's tokenizer and config.json, `model_inputs`: the content fingerprint of the folders the model
started from, `verify.py`). `read_manifest` checks the type of every key a reader uses (a manifest is data
from disk); `verify_files` splits the hashing among the ranks and fails with one line naming the file.
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


# what readers take from a manifest, by key: the types it must have (absent keys are the writer's older versions;
# `files` and `step` every manifest has)
_NONE = type(None)
_TYPES: dict[str, tuple[type, ...]] = {
    "files": (dict,), "step": (int,), "contents": (list,), "model_args": (dict,), "strategy": (str,),
    "world_size": (int,), "layout": (dict,), "config_digest": (str,), "ckpt_format": (str,), "format_version": (int,),
    "peft": (dict,), "peft_base": (dict,), "tokenizer": (str, _NONE), "hf_config": (dict, _NONE),
    "imported_from": (str,), "model_inputs": (dict,), "torch_version": (str,), "created_utc": (str,)}
_REQUIRED = ("files", "step")


def _type_names(types: tuple[type, ...]) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", _NONE: "null"}
    return " or ".join(names[t] for t in types)


def read_manifest(path: Path) -> dict:
    """`path`'s manifest.json, every key a reader uses of the right type: else one line naming the file and the
    key (a manifest is data from disk: damaged, edited or crafted)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: missing (not a complete meshforge checkpoint)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, RecursionError) as err:  # (UnicodeDecodeError is a ValueError)
        raise CheckpointError(f"{mpath}: unreadable manifest ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{mpath}: not a manifest (a JSON {type(manifest).__name__}, not an object)")
    for key, types in _TYPES.items():
        if key not in manifest:
            if key in _REQUIRED:
                raise CheckpointError(f"{mpath}: key {key} is missing")
        elif not isinstance(manifest[key], types) or (isinstance(manifest[key], bool) and bool not in types):
            raise CheckpointError(f"{mpath}: key {key} must be {_type_names(types)}, not "
                                  f"{json.dumps(manifest[key])[:60]}")
    for name, entry in manifest["files"].items():
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{mpath}: files: {name[:60]!r} is not a file name in the checkpoint's folder")
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{mpath}: files.{name} must be an object with bytes (an integer) and sha256 "
                                  "(a string)")
    if not all(isinstance(v, str) for v in manifest.get("contents", [])):
        raise CheckpointError(f"{mpath}: key contents must be a list of strings")
    _check_model_args(mpath, manifest.get("model_args", {}))
    return manifest


def _check_model_args(mpath: Path, saved: dict) -> None:
    from meshforge.models import ModelArgs

    kinds = {bool: (bool,), int: (int, float), float: (int, float), str: (str,)}  # a number is a number
    for f in dataclasses.fields(ModelArgs):
        want, got = type(f.default), saved.get(f.name)
        if f.name in saved and want in kinds and got is not None and (
                type(got) not in kinds[want] or (want is not bool and isinstance(got, bool))):
            raise CheckpointError(f"{mpath}: model_args.{f.name} must be {want.__name__}, not {json.dumps(got)[:60]}")


def manifest_model_args(path: Path, manifest: dict):
    """The `ModelArgs` a manifest (`read_manifest`) records: one line naming the key a damaged one gets wrong."""
    from meshforge.models import ModelArgs

    where = Path(path) / MANIFEST
    if "model_args" not in manifest:
        raise CheckpointError(f"{where}: key model_args is missing")
    try:
        return ModelArgs(**manifest["model_args"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: model_args: {str(err)[:200]}") from None


def verify_files(path: Path, manifest: dict | None = None, group=None) -> dict:
    """Check every file of the manifest (hashing split among the ranks); the manifest, or a one-line error."""
    path = Path(path)
    if manifest is None:
        manifest = read_manifest(path)
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
