"""Helpers shared by the checkpoint tests: the `meshforge train` command line and finding its worker processes."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from meshforge.testing.parity import base_overrides


def env(**extra) -> dict:
    e = {**os.environ, "OMP_NUM_THREADS": "1"}
    e.pop("MESHFORGE_FAULT", None)
    e.update(extra)
    return e


def cli_cmd(overrides: list[str], nproc: int, cfg_file: Path, steps: int = 20) -> list[str]:
    return [sys.executable, "-m", "meshforge", "train", str(cfg_file), *base_overrides(steps), *overrides,
            f"--nproc-per-node={nproc}"]


def write_cfg(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("run:\n  name: ckpt-test\n")
    return path


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(d.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        envs = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for e in envs:
        if e.startswith(b"RANK="):
            return int(e[5:])
    return None


def worker_pids(launcher_pid: int, n: int, timeout: float = 240) -> dict[int, int]:
    """{rank: pid} of the `n` training processes under a `meshforge train --nproc-per-node` launcher."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = []
        stack = [launcher_pid]
        while stack:
            for c in children(stack.pop()):
                try:
                    cmdline = (Path("/proc") / str(c) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if "meshforge" in cmdline and _rank_of(c) is not None:
                    found.append(c)
                stack.append(c)
        ranks = {_rank_of(p): p for p in found}
        if len(ranks) >= n:
            return ranks
        time.sleep(0.2)
    raise RuntimeError(f"did not find {n} workers under {launcher_pid}")
