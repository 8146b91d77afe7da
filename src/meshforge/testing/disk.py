"""Real storage faults for the tests: a small tmpfs to fill, remount read-only, or lose (needs root and mount(8))."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[str | None]:
    """A tmpfs of `size` ("2500k") mounted at `where` (made if missing) for the block, then unmounted; yields None,
    or why none could be mounted here (the caller skips with it)."""
    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        yield "mounting a small tmpfs needs root and mount(8)"
        return
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if proc.returncode != 0:
        yield f"cannot mount a tmpfs here ({proc.stderr.decode().strip()[:100]})"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def remount_read_only(where: Path) -> None:
    """Turn the tmpfs at `where` read-only, as a storage that fails over to read-only does."""
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
