"""A finished run must exit 0 every time: run `meshforge bench --sweep distributed.strategy=ddp,fsdp2,megatron_fsdp
--nproc-per-node 2` on the small preset N times in a row (fresh processes each time) and count the exits.

    python benchmarks/repeat_bench.py [--runs 20] [--steps 3] [--preset small]

Prints one line per run (exit code, seconds, and any `terminate called` / SIGABRT / Traceback found in its
output, whose tail is kept under --keep) and a summary line "N/N runs exited 0". Exit status: 0 only when every
run exited 0 with no abort message. Not a test (it takes minutes): the issue's acceptance loop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """model: {{preset: {preset}}}
data: {{source: synthetic}}
training: {{seq_len: 64, global_batch_size: 8, micro_batch_size: 2, device: cpu, precision: fp32}}
checkpoint: {{resume: none}}
"""
BAD = ("terminate called", "SIGABRT", "Aborted", "Traceback", "core dumped")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--preset", default="small")
    p.add_argument("--keep", default=None, help="directory for the output of failed runs (default: a temp dir)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshforge-repeat-"))
    keep = Path(a.keep) if a.keep else work / "failed"
    cfg = work / "bench.yaml"
    cfg.write_text(CONFIG.format(preset=a.preset))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = 0
    for i in range(1, a.runs + 1):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "meshforge", "bench", str(cfg), "--nproc-per-node", "2",
                               "--sweep", "distributed.strategy=ddp,fsdp2,megatron_fsdp", "--steps", str(a.steps),
                               "--warmup", "1", "--output-dir", str(work / f"run{i}")],
                              capture_output=True, text=True, env=env)
        text = proc.stdout + proc.stderr
        found = [b for b in BAD if b in text]
        good = proc.returncode == 0 and not found
        ok += good
        if not good:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"run{i}.log").write_text(text)
        print(f"run {i:2d}/{a.runs}: exit {proc.returncode} in {time.perf_counter() - t0:5.1f} s"
              + (f"  FOUND {found} (log: {keep / f'run{i}.log'})" if found or not good else ""), flush=True)
    print(f"{ok}/{a.runs} runs exited 0 with no abort", flush=True)
    return 0 if ok == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
