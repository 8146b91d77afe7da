"""Reading DCP checkpoints without running pickled code: `.metadata` through a restricted unpickler, non-tensor
items through `torch.load(weights_only=True)`, and one line for any failed load.

DCP pickles `.metadata`, and reads non-tensor items (optimizer param groups) with `weights_only=False`: a
crafted checkpoint would run code on load, and the manifest's hashes prove nothing (whoever writes the file
writes them too). Every meshforge read of a DCP checkpoint (resume, export, inspect) goes through `dcp_load`
or `load_dcp_metadata` here; `dcp_tensor_shapes` gives shapes and dtypes from the metadata alone.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshforge.errors import CheckpointError

# DCP warns on every single-process save/load; meshforge passes no_dist deliberately there
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

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
    `offsets`, each tensor is the box of the saved one starting there (`BoxLoadPlanner`). Any failure is one
    line, `<path>: DCP load failed: <error>`: a refused item's own error, else the first failing rank's."""
    planner = SafeLoadPlanner() if offsets is None else BoxLoadPlanner(offsets)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner, no_dist=no_dist)
    except CheckpointException as err:  # DCP wraps each rank's error: ours is the one line to show
        ours = [inner for _rank, (inner, _tb) in sorted(err.failures.items()) if isinstance(inner, CheckpointError)]
        raise CheckpointError(f"{path}: DCP load failed: {dcp_error_line(ours[0] if ours else err)}") from None
    except Exception as err:  # noqa: BLE001 - one line naming the checkpoint
        raise CheckpointError(f"{path}: DCP load failed: {dcp_error_line(err)}") from None


def dcp_tensor_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{state-dict key: (global shape, dtype)} of every tensor in a DCP checkpoint."""
    md = load_dcp_metadata(path)
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def dcp_error_line(err: BaseException) -> str:
    """One line for a failed DCP save/load: the first failing rank's own error, not DCP's wrapper."""
    prefix = ""
    if isinstance(err, CheckpointException) and err.failures:
        rank, (err, _) = min(err.failures.items())
        prefix = f"rank {rank}: "
    first = str(err).strip().splitlines()
    return prefix + (f"{type(err).__name__}: {first[0]}" if first else type(err).__name__)
