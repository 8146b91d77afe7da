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
import io
import json
import os
import pickle
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


def umask() -> int:
    """This process's umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give a file the mode a plain `open(path, "w")` would have: writers that go through a private temporary
    file (safetensors' save_file) leave it 0600, unreadable to the colleague it was written for."""
    os.chmod(path, 0o666 & ~umask())


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


# ------------------------------------------------------------------ DCP metadata, safely
# DCP pickles `.metadata`; plain `pickle.load` of a crafted file runs any code (the manifest's hashes prove
# nothing: whoever writes the file writes them too). These are the only globals DCP metadata refers to.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                 ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                 ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                 ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if module in _SAFE_MODULES and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # a dataclass or an enum of DCP's own; never a function
                return obj
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}: DCP metadata never holds it")


def load_dcp_metadata(path: Path):
    """`<path>/.metadata` through the restricted unpickler; a one-line CheckpointError when it is refused,
    truncated or not DCP metadata at all."""
    from torch.distributed.checkpoint.metadata import Metadata

    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing (not a DCP checkpoint)") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure of a damaged or crafted file
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{f}: unreadable or unsafe DCP metadata ({type(err).__name__}: {first})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{f}: not DCP metadata (holds a {type(md).__name__})")
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` loaded by the restricted unpickler (every load goes through it)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = load_dcp_metadata(Path(str(self.path)))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's load planner with non-tensor items (optimizer param groups, ...) read by `torch.load(weights_only=
    True)`: DCP's own reads them with `weights_only=False`, which runs whatever a crafted `.distcp` pickles."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001 - one line naming the item
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn}: refused by torch.load(weights_only="
                                  f"True) ({type(err).__name__}: {first})") from None
        safe = io.BytesIO()  # what passed weights_only, re-serialised: DCP's own unpickling of it is harmless
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


class BoxLoadPlanner(SafeLoadPlanner):
    """Reads, for each tensor of the state dict, only the box of the saved tensor that starts at `offsets[key]`
    and has the state-dict tensor's shape (e.g. a few experts of a stacked expert weight)."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__()
        self.offsets = offsets

    def create_local_plan(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        items = []
        for fqn, t in self.state_dict.items():
            box = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]), sizes=t.size())
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [box])
        return LoadPlan(items)

    def lookup_tensor(self, index):  # the box itself (DCP's default looks a non-zero offset up as a shard)
        return self.state_dict[index.fqn]


def dcp_load(state: dict, path: Path, no_dist: bool, offsets: dict[str, tuple[int, ...]] | None = None) -> None:
    """`dcp.load` of `state` from the checkpoint at `path`: metadata and non-tensor items read safely. With
    `offsets`, each tensor is the box of the saved one starting there (`BoxLoadPlanner`)."""
    planner = SafeLoadPlanner() if offsets is None else BoxLoadPlanner(offsets)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, no_dist=no_dist)
    except CheckpointException as err:  # DCP wraps each rank's error: ours is already the one line to show
        for _rank, (inner, _tb) in sorted(err.failures.items()):
            if isinstance(inner, CheckpointError):
                raise inner from None
        raise


def dcp_tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{state-dict key: (global shape, dtype)} of every tensor in a DCP checkpoint."""
    md = load_dcp_metadata(path)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _names(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_model_keys(path: Path, mine: dict[str, tuple[int, ...]], allow_partial: bool) -> set[str] | None:
    """None when the checkpoint's `model.*` tensors are exactly this model's (`mine`: every name of the whole
    model with its full shape); else a one-line CheckpointError, or with `allow_partial`
    (checkpoint.allow_partial_load) the names both have (their shapes must still match)."""
    saved = {k.removeprefix("model."): v for k, v in dcp_tensor_shapes(path).items() if k.startswith("model.")}
    for fqn in sorted(set(saved) & set(mine)):
        if saved[fqn][0] != mine[fqn]:
            raise CheckpointError(f"{path}: parameter {fqn} has shape {saved[fqn][0]} in the checkpoint but "
                                  f"{mine[fqn]} in this model (model.* differs from the run that saved it)")
    missing, extra = set(mine) - set(saved), set(saved) - set(mine)
    if (missing or extra) and not allow_partial:
        parts = ([f"missing from the checkpoint: {_names(missing)}"] if missing else []) + \
                ([f"in the checkpoint but not in this model: {_names(extra)}"] if extra else [])
        raise CheckpointError(f"{path}: saved from another model ({'; '.join(parts)}); set "
                              "checkpoint.allow_partial_load=true to load only the tensors both have")
    return set(mine) & set(saved) if missing or extra else None


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
