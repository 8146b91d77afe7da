"""Preemption (an external SIGTERM to one rank) and a rank that hangs in a collective, through `meshforge train`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from ckpt_helpers import cli_cmd, env, worker_pids, write_cfg

pytestmark = [pytest.mark.dist, pytest.mark.slow]

def _last_logged_step(metrics) -> int:
    try:
        lines = metrics.read_text().strip().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_to_one_rank_saves_and_exits_zero_within_grace(tmp_path):
    cfg = write_cfg(tmp_path / "cfg.yaml")
    out = tmp_path / "run"
    grace = 60.0  # generous: worker teardown alone takes seconds on a loaded 2-core machine
    cmd = cli_cmd(["distributed.strategy=fsdp2", f"run.output_dir={out}", "logging.jsonl=true",
                   "logging.log_every=1", f"checkpoint.grace_period_s={grace}"], 2, cfg, steps=100000)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        pids = worker_pids(proc.pid, 2)
        deadline = time.time() + 120
        while _last_logged_step(out / "metrics.jsonl") < 2 and time.time() < deadline:
            time.sleep(0.1)
        t_sig = time.perf_counter()
        os.kill(pids[1], signal.SIGTERM)  # SLURM-style: only one rank is told
        while any(_alive(p) for p in pids.values()) and time.perf_counter() - t_sig < grace + 30:
            time.sleep(0.05)
        elapsed = time.perf_counter() - t_sig  # what a scheduler's grace period measures: the ranks' exit
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    last = _last_logged_step(out / "metrics.jsonl")
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    print(f"SIGTERM to rank 1: ranks exited {elapsed:.2f} s after the signal (launcher exit {proc.returncode}); "
          f"{[ln for ln in stdout.splitlines() if 'synchronous save' in ln]}; LATEST={latest}, "
          f"last logged step {last}")
    assert proc.returncode == 0, stderr[-3000:]
    assert elapsed < grace
    assert latest == f"step_{last}" and f"stop signal received: saved step {last} and exiting" in stdout
    assert (out / "checkpoints" / latest / "manifest.json").is_file()


def test_hung_rank_ends_the_job_with_one_summary_of_where(tmp_path):
    """Rank 1 sleeps after step 2 instead of joining the next collective; within distributed.timeout_minutes
    (0.1 min = 6 s) + 30 s the job ends with one summary (distributed/hang.py) naming the step, the axis, the
    collective, who entered and who did not, and rank 1's Python stack; exit code 4 (docs/faults.md)."""
    cfg = write_cfg(tmp_path / "cfg.yaml")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cli_cmd(["distributed.strategy=ddp", f"run.output_dir={tmp_path}/run",
                                     "distributed.timeout_minutes=0.1", "checkpoint.interval=1000"], 2, cfg),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env(MESHFORGE_FAULT="hang_at_step:2:1:600"))
    stamped = []  # (seconds since start, line)
    for line in proc.stderr:
        stamped.append((time.perf_counter() - t0, line.rstrip()))
    proc.wait(timeout=240)
    wall = time.perf_counter() - t0
    err = "\n".join(ln for _, ln in stamped)
    t_hang = next(t for t, ln in stamped if "hangs for" in ln)
    t_sum = next((t for t, ln in stamped if ln.startswith("error: hang at step 3: ")), None)
    block = [ln for _, ln in stamped if ln.startswith("error: ") and "failed (exit codes" not in ln]
    print(f"hang: the summary came {t_sum - t_hang if t_sum else float('nan'):.1f} s after rank 1 started hanging "
          f"(timeout 6 s); exit {proc.returncode} after {wall:.1f} s incl. start; the job said:", *block, sep="\n")
    assert t_sum is not None and 5.0 <= t_sum - t_hang < 6 + 30, err[-3000:]
    assert proc.returncode == 4, err[-3000:]
    summary = "\n".join(block)
    assert "did not complete within distributed.timeout_minutes=0.1 (6 s)" in summary
    assert "on mesh axis dp" in summary and "gloo:" in summary
    assert "entered: ranks [0]; not entered: ranks [1]" in summary
    assert "rank 1 is at step 2" in summary and "time.sleep(seconds)" in summary  # where rank 1 is: its stack
    assert "Traceback" not in err and summary.count("hang at step") == 1
