"""A checkpoint directory on disk: paths, LATEST, the manifest, atomic writes and the integrity check.

Layout of `checkpoint.dir` (default `<run.output_dir>/checkpoints`)::

    LATEST                      one line: the name of the newest complete checkpoint ("step_20")
    step_<N>/                   a complete checkpoint (see `manager.py` for what is in it)
        manifest.json           written last: step, config digest, world layout, every file's bytes + sha256

`verify_files` checks every file against the manifest (the hashing split among the ranks) and fails with
one line naming the file; `dcp_tensor_shapes` reads tensor shapes from DCP metadata without loading data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshforge.errors import CheckpointError

# DCP warns on every single-process save/load; meshforge passes no_dist deliberately there
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


# ------------------------------------------------------------------------------ paths
def checkpoint_dir(cfg) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join(cfg.run.output_dir, "checkpoints"))


def has_checkpoint(cfg) -> bool:
    return (checkpoint_dir(cfg) / "LATEST").is_file()


def read_latest(root: Path) -> Path | None:
    f = Path(root) / "LATEST"
    if not f.is_file():
        return None
    name = f.read_text().strip()
    return Path(root) / name if name else None


def complete_checkpoints(root: Path) -> list[Path]:
    """`step_<N>` directories that hold a manifest, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
             and (p / MANIFEST).is_file()]
    return [p for _, p in sorted(found, reverse=True)]


def resolve_checkpoint_path(path: str | Path) -> Path:
    """A checkpoint dir as given, or LATEST's target inside a checkpoints dir or a run dir."""
    p = Path(path)
    for root in (p, p / "checkpoints"):
        target = read_latest(root)
        if target is not None and not (p / MANIFEST).is_file():
            return target
    return p


# ------------------------------------------------------------------------ small helpers
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def file_entry(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(group=None) -> None:
    if dist_on():
        dist.barrier(group=group)


def all_gather_object(obj, group=None) -> list:
    if not dist_on():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank() -> int:
    return dist.get_rank() if dist_on() else 0


def world() -> int:
    return dist.get_world_size() if dist_on() else 1


def log(msg: str, warn: bool = False) -> None:
    if rank() == 0:
        print(f"{'warning: ' if warn else ''}checkpoint: {msg}", file=sys.stderr if warn else sys.stdout,
              flush=True)


# ---------------------------------------------------------------------- verification
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


def dcp_tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{state-dict key: (global shape, dtype)} of every tensor in a DCP checkpoint."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def check_model_shapes(path: Path, model_sd: dict) -> None:
    saved = dcp_tensor_shapes(path)
    for fqn, t in model_sd.items():
        mine = tuple(t.shape)
        key = f"model.{fqn}"
        if key not in saved:
            raise CheckpointError(f"{path}: parameter {fqn} (shape {mine}) is not in the checkpoint; it was saved "
                                  "from another model")
        if saved[key][0] != mine:
            raise CheckpointError(f"{path}: parameter {fqn} has shape {saved[key][0]} in the checkpoint but {mine} "
                                  "in this model (model.* differs from the run that saved it)")


# DCP raises CheckpointException, a BaseException (not an Exception), carrying each failing rank's error
DCP_ERRORS = (Exception, CheckpointException)


def dcp_error_line(err: BaseException) -> str:
    """One line for a failed DCP save/load: the first failing rank's own error, not DCP's wrapper."""
    prefix = ""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (err, _) = min(err.failures.items())
        prefix = f"rank {rank}: "
    first = str(err).strip().splitlines()
    return prefix + (f"{type(err).__name__}: {first[0]}" if first else type(err).__name__)
