"""Where meshforge writes, and what it never does there (docs/files.md lists the guarantees and their tests).

An output folder (a run directory, a checkpoints folder, an export) is one of:
- new: missing or empty; meshforge creates it and leaves the marker `.meshforge-output` in it, naming the kind;
- meshforge's own earlier output of the same kind: its marker says so (a folder written before markers existed
  is recognised by what a run or a checkpoints folder holds, `kind_of`);
- anything else: refused with one line. An explicit flag (`run.overwrite`) may move it aside, never delete it.
Whatever the flags: never the filesystem root, the home folder, the working directory or an ancestor of them,
never a folder that holds the command's own inputs, and never a place inside (or equal to) another run
directory or checkpoints folder. Paths are compared resolved (symlinks, `..`, relative spellings).

Replacing a folder (`replace_folder`): the new output is written beside it under a hidden name, swapped in by
one atomic rename (Linux `renameat2(RENAME_EXCHANGE)`; elsewhere rename-aside then rename, which the next call
repairs if a kill fell between the two), and only then is the old one deleted: a kill at any moment leaves the
old or the new output whole under its name. An output file (`check_file`, `publish_file`) is written under a
temporary name beside it and moved over with `os.replace`, so it too is old or new, never half of either.

Torch-free and meshforge-free below `errors`: any layer may use it.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

MARKER = ".meshforge-output"
LOCK = ".meshforge.lock"  # a running run's claim on its folders (training/rundir.py)
PROBE = ".meshforge-write-test."  # a rank's write test, there for an instant (training/rundir.py)
RUN, CHECKPOINTS, EXPORT = "run", "checkpoints", "export"
_STEP = re.compile(r"^step_\d+$")
_RUN_SIGNS = ("metrics.jsonl", "run_meta.json")  # what only a run directory holds
T = TypeVar("T")


def resolved(path: str | Path) -> Path:
    """The absolute path with symlinks and `..` resolved (a missing tail is kept as spelled)."""
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


# --------------------------------------------------------------------------------- kinds
def mark(folder: Path, kind: str) -> None:
    """Leave the marker naming what meshforge wrote here (an existing marker of that kind is kept as it is)."""
    try:
        if json.loads((Path(folder) / MARKER).read_text()).get("kind") == kind:
            return
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    tmp = Path(folder) / f"{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"kind": kind, "created_utc": stamp}) + "\n")
    os.replace(tmp, Path(folder) / MARKER)


def _holds_checkpoints(folder: Path) -> bool:
    try:
        return (folder / "LATEST").is_file() or any(_STEP.match(p.name) and p.is_dir() for p in folder.iterdir())
    except OSError:
        return False


def kind_of(folder: Path) -> str | None:
    """What meshforge output `folder` is: its marker's kind; for folders from before markers, "checkpoints"
    (a LATEST file or step_N folders) or "run" (metrics, run metadata, or a checkpoints folder); else None
    (missing, empty, or not meshforge's)."""
    folder = Path(folder)
    try:
        kind = json.loads((folder / MARKER).read_text()).get("kind")
        if isinstance(kind, str):
            return kind
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    if not folder.is_dir():
        return None
    if _holds_checkpoints(folder):
        return CHECKPOINTS
    if any((folder / s).exists() for s in _RUN_SIGNS) or _holds_checkpoints(folder / "checkpoints"):
        return RUN
    return None


def is_empty(folder: Path) -> bool:
    try:
        return not any(Path(folder).iterdir())
    except OSError:
        return not Path(folder).exists()


def _holds_files(folder: Path) -> bool:
    try:
        return any(p.name != LOCK and not p.name.startswith(PROBE)
                   and (not p.is_dir() or p.is_symlink() or _holds_files(p)) for p in folder.iterdir())
    except OSError:
        return False


def is_foreign(folder: Path) -> bool:
    """A folder that holds files, none of them recognisably meshforge's (a lock alone is meshforge's; empty
    folders hold nothing, e.g. a checkpoints folder another rank has just created, nor does another rank's
    write test in it: rank 0 looks while the others probe, and once took a fresh run for someone else's)."""
    folder = Path(folder)
    return folder.is_dir() and kind_of(folder) is None and _holds_files(folder)


def entries(folder: Path, limit: int = 3) -> str:
    """A few of `folder`'s entries, for a message."""
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(folder).iterdir())
    except OSError:
        return "?"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def enclosing(path: str | Path) -> tuple[Path, str] | None:
    """The nearest folder strictly above `path` that is a run directory or a checkpoints folder, with its kind."""
    p = resolved(path)
    for parent in p.parents:
        kind = kind_of(parent)
        if kind in (RUN, CHECKPOINTS):
            return parent, kind
    return None


def protected(path: str | Path) -> str | None:
    """Why `path` may never be an output folder (the root, home, the working directory or an ancestor of them),
    or None."""
    p = resolved(path)
    if p == Path(p.anchor):
        return "the filesystem root"
    for name, where in (("the home folder", Path.home()), ("the working directory", Path.cwd())):
        try:
            w = resolved(where)
        except OSError:
            continue
        if p == w:
            return name
        if w.is_relative_to(p):
            return f"a folder that holds {name} ({w})"
    return None


def _sources_inside(p: Path, sources: Iterable[str | Path]) -> Path | None:
    for s in sources:
        try:
            r = resolved(s)
        except OSError:
            continue
        if r == p or r.is_relative_to(p):
            return Path(s)
    return None


# ----------------------------------------------------------------------------- folders
def check_place(path: str | Path, key: str, sources: Iterable[str | Path] = ()) -> str | None:
    """None when an output folder may live at `path` whatever it holds now; else the one line that refuses it
    (root, home, the working directory or above; holding an input; inside another run or checkpoints folder;
    a file). `key` names the setting or flag in the message; `sources` are the command's inputs."""
    p = resolved(path)
    if (why := protected(p)) is not None:
        return f"{key}={path} is {why}: meshforge never writes its output there; give a new folder"
    if (src := _sources_inside(p, sources)) is not None:
        return f"{key}={path} holds this command's own input {src}: give a new folder"
    if (outer := enclosing(p)) is not None:
        return (f"{key}={path} is inside the {'run directory' if outer[1] == RUN else 'checkpoints folder'} "
                f"{outer[0]}: give a folder outside it")
    if p.exists() and not p.is_dir():
        return f"{key}={path} is a file, not a folder: give a new folder"
    return None


def check_folder(path: str | Path, kind: str, key: str, sources: Iterable[str | Path] = ()) -> str | None:
    """`check_place`, and `path` is new, empty, or an earlier `kind` output: None when a new `kind` output may
    replace it; else the one line that refuses it."""
    if (problem := check_place(path, key, sources)) is not None:
        return problem
    p = resolved(path)
    have = kind_of(p)
    if have in (RUN, CHECKPOINTS) and kind != have:
        return f"{key}={path} is a meshforge {have} {'directory' if have == RUN else 'folder'}: give a new folder"
    if have != kind and is_foreign(p):
        return (f"{key}={path} holds files meshforge did not write ({entries(p)}): give a new or empty folder "
                "(meshforge replaces only its own earlier output)")
    return None


def move_aside(folder: Path) -> Path:
    """Rename `folder` to `<folder>.replaced-<UTC time>` (never deleted); returns the new name."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    aside = folder.with_name(f"{folder.name}.replaced-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{folder.name}.replaced-{stamp}-{n}")
    os.rename(folder, aside)
    return aside


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):  # a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(a))


def _siblings(dest: Path, tag: str) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.{tag}-*"))


def recover(dest: Path) -> None:
    """Finish or undo a replacement a kill interrupted: unpublished new outputs are deleted; an old output set
    aside is put back when nothing took its place, else deleted."""
    dest = Path(dest)
    for staged in _siblings(dest, "partial"):
        shutil.rmtree(staged, ignore_errors=True)
    for old in _siblings(dest, "old"):
        if not dest.exists():
            os.rename(old, dest)
        else:
            shutil.rmtree(old, ignore_errors=True)


def replace_folder(dest: str | Path, kind: str, write: Callable[[Path], T]) -> T:
    """Write a `kind` output with `write(folder)` into a hidden folder beside `dest`, mark it, then swap it in
    for `dest` and delete what `dest` held. Call `check_folder` first: this replaces whatever is there."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    staged = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    try:
        result = write(staged)
        mark(staged, kind)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if not dest.exists():
        os.rename(staged, dest)
    elif _exchange(staged, dest):  # dest is the new output now; `staged` holds the old one
        shutil.rmtree(staged, ignore_errors=True)
    else:
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(staged, dest)
        shutil.rmtree(old, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------- files
def check_file(path: str | Path, key: str, is_own: Callable[[Path], bool], what: str,
               sources: Iterable[str | Path] = ()) -> str | None:
    """None when the file `path` may be written (new, or an earlier `what` that `is_own` recognises); else one
    line. Never one of the command's inputs, never inside a checkpoints folder, never through a file."""
    p = Path(path)
    if p.name in ("", ".", "..") or p.is_dir():
        return f"{key}={path} is a folder: give a file name inside it"
    r = resolved(p)
    if (src := _sources_inside(r, sources)) is not None and resolved(src) == r:
        return f"{key}={path} is one of this command's inputs: give another file name"
    outer = enclosing(r)
    if outer is not None and outer[1] == CHECKPOINTS:
        return f"{key}={path} is inside the checkpoints folder {outer[0]}: write it elsewhere"
    blocker = next((a for a in r.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        return f"{key}={path} cannot be written: {blocker} is a file, not a folder"
    if p.exists() and not is_own(p):
        return f"{key}={path} already holds a file that is not {what}: meshforge does not overwrite it; give " \
               "another file name"
    return None


def temp_beside(dest: Path, suffix: str = "") -> Path:
    """A temporary name next to `dest` (same filesystem, so `publish_file` is one atomic rename)."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.tmp{suffix}")


def publish_file(tmp: Path, dest: Path) -> None:
    """Move a fully written `tmp` over `dest` in one step."""
    os.replace(tmp, dest)
