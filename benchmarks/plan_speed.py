"""How long `meshforge plan` and `meshforge plan --fit` take for every example config (issue 27: a plan answer
stays under 2 s without --trace).

Each command runs in its own process, as a user runs it (imports included), `--repeat` times; printed per
example and world size: the least CPU seconds (user + system) of the runs and their least wall seconds, or the
command's one-line refusal (a world size the example's batch does not split over). CPU time is the number to
read on a shared machine: wall time grows with the load, CPU time much less.

Usage: python benchmarks/plan_speed.py [--world-sizes 64,1024,16384] [--repeat 3] [--only NAME,...] [--no-fit]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(args: list[str]) -> tuple[float, float, int, str]:
    """(CPU seconds, wall seconds, exit code, the first line of its error output) of one `meshforge` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "meshforge", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONHASHSEED="0"))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    error = (proc.stderr.strip().splitlines() or [""])[0] if proc.returncode else ""
    return cpu, wall, proc.returncode, error


def measure(args: list[str], repeat: int) -> str:
    runs = [run_once(args) for _ in range(repeat)]
    cpu, wall = min(r[0] for r in runs), min(r[1] for r in runs)
    rc, error = runs[0][2], runs[0][3]
    text = f"{cpu:6.2f} s CPU ({wall:5.2f} s wall)"
    return text + (f"  exit {rc}: {error[:90]}" if rc else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="64,1024,16384")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="example names (file stems), comma-separated")
    ap.add_argument("--no-fit", action="store_true", help="time plain `plan` only")
    opts = ap.parse_args()
    only = {n for n in opts.only.split(",") if n}
    examples = [p for p in sorted((ROOT / "examples").glob("*.yaml")) if not only or p.stem in only]
    for path in examples:
        for ws in opts.world_sizes.split(","):
            base = ["plan", str(path.relative_to(ROOT)), "--world-size", ws]
            line = f"{path.stem:24s} {ws:>6s}  plan {measure(base, opts.repeat)}"
            if not opts.no_fit:
                line += f" | --fit {measure(base + ['--fit'], opts.repeat)}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
