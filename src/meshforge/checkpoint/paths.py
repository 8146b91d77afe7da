"""The checkpoints directory on disk: where each thing is, `LATEST`, and writes a reader never sees half done.

Layout of `checkpoint.dir` (default `<run.output_dir>/checkpoints`)::

    LATEST                      one line: the name of the newest complete checkpoint ("step_20")
    step_<N>/                   a complete checkpoint: it holds `manifest.json` (written last, `manifest.py`)
    step_<N>.partial/           a save in progress (or interrupted: removed when the next manager starts)
    hf/step_<N>/                `checkpoint.save_consolidated`: Hugging Face safetensors + config.json

A file is written whole (`write_atomic`: a temporary file, fsync, `os.replace`); a folder is written under a
`.partial` name and renamed into place (`publish_checkpoint`, which then moves `LATEST`); an export folder is
swapped in whole (`write_export`). Retention (`remove_old`) never deletes the checkpoint `LATEST` names.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import meshforge.outputs as outputs
from meshforge.checkpoint.manifest import MANIFEST

_STEP_RE = re.compile(r"^step_(\d+)$")
T = TypeVar("T")


# ------------------------------------------------------------------------------ finding
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


# ------------------------------------------------------------------------- writing whole
def fsync_dir(path: Path) -> None:
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
    fsync_dir(path.parent)


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


def write_export(out_dir: Path, write: Callable[[Path], T]) -> T:
    """Write an export folder with `write(folder)` and put it in place whole, replacing an earlier export
    (`outputs.replace_folder`: a kill at any moment leaves the old or the new export). Where it may go is the
    caller's check (`outputs.check_folder`, the command's `--to`); `save_consolidated`'s own hf/step_N needs none."""
    return outputs.replace_folder(out_dir, outputs.EXPORT, write)


def publish_checkpoint(partial: Path, final: Path) -> None:
    """Rename a finished `step_<N>.partial` (its manifest written) to `step_<N>`, replacing a checkpoint of the
    same step (e.g. saved again after a resume), then point `LATEST` at it."""
    root = final.parent
    if final.exists():
        old = final.with_name(final.name + ".old.partial")
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(partial, final)
    fsync_dir(root)
    write_atomic(root / "LATEST", final.name + "\n")


# ---------------------------------------------------------------------------- clearing
def remove_leftovers(root: Path) -> list[Path]:
    """Delete interrupted saves and exports (`*.partial`) and a stale `LATEST.tmp`; the folders removed."""
    removed = []
    if root.is_dir():
        for p in sorted(root.glob("*.partial")):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        for p in sorted(root.glob("hf/.step_*-*")):  # an interrupted export: finished or undone (`recover`)
            if (m := re.match(r"^\.(step_\d+)\.(partial|old)-\d+$", p.name)):
                removed.append(p)
                outputs.recover(p.with_name(m.group(1)))
        (root / "LATEST.tmp").unlink(missing_ok=True)
    return removed


def remove_old(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the `keep_last` newest complete checkpoints, never the one LATEST names; those deleted."""
    latest = read_latest(root)
    done = complete_checkpoints(root)
    keep = set(done[:keep_last]) | ({latest} if latest else set())
    deleted = [p for p in done if p not in keep]
    for p in deleted:
        shutil.rmtree(p, ignore_errors=True)
    return deleted
