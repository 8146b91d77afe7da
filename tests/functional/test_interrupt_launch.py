"""Ctrl-C at a terminal running `meshforge train --nproc-per-node 2`: the launcher and every rank get SIGINT (one
process group). The ranks finish the step, save, and everything exits 130 with no traceback; the launcher's
forwarding of the same Ctrl-C is not taken for a second one. This test pays for its own launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from meshforge.testing.parity import base_overrides

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_ctrl_c_to_a_launch_saves_and_exits_130(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: ctrl-c}\n")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "meshforge", "train", str(cfg), "--nproc-per-node", "2", *base_overrides(100000),
           "training.global_batch_size=4", "logging.jsonl=true", "logging.log_every=1", f"run.output_dir={out}",
           "distributed.strategy=ddp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MESHFORGE_FAULT", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    deadline = time.time() + 300
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    assert proc.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    assert "second interrupt" not in stderr, stderr[-4000:]
    latest = (out / "checkpoints" / "LATEST").read_text().strip()
    assert latest.startswith("step_") and f"saved step {latest[5:]} and exiting (SIGINT)" in stdout, stdout[-2000:]
    assert "SIGINT received" in stderr
