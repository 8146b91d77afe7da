"""Multi-node start-up that talks (issue 29 item 5): node 0 of a 2-node launch whose second node never comes
says what it waits for (endpoint, nodes joined of expected, the timeout), gives up at
`distributed.rendezvous_timeout_s` with one line and exit 4, and Ctrl-C ends the wait at once with exit 130,
also in the static rendezvous, where the main thread sits in a C++ store call until the timeout. Both launches run
side by side; each pays for its own process (a rendezvous is not a group job)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CTRL_C_WITHIN_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node0(tmp_path: Path, name: str, timeout_s: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "MESHFORGE_FAULT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "meshforge", "train", "examples/tiny_cpu.yaml", f"run.output_dir={tmp_path / name}",
           f"distributed.rendezvous_timeout_s={timeout_s}", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *flags]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(proc: subprocess.Popen, timeout: float) -> tuple[int, list[str]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err.strip().splitlines()


def test_a_node_alone_says_what_it_waits_for_gives_up_and_stops_on_ctrl_c(tmp_path):
    gives_up = _node0(tmp_path, "c10d", 3)  # the c10d rendezvous: nodes joined come from its state
    ctrl_c = _node0(tmp_path, "static", 600, "--node-rank", "0")
    try:
        deadline, said = time.time() + 240, ""
        while "waiting for the other nodes" not in said:  # the line comes before anything else on stderr
            assert time.time() < deadline and ctrl_c.poll() is None, "node 0 never said it was waiting"
            said = ctrl_c.stderr.readline()
        t0 = time.perf_counter()
        ctrl_c.send_signal(signal.SIGINT)
        rc, rest = _lines(ctrl_c, 60)
        stopped_s = time.perf_counter() - t0
    finally:
        ctrl_c.kill()
    assert rc == 130 and stopped_s < CTRL_C_WITHIN_S, (rc, stopped_s, rest)
    assert "(static rendezvous, id meshforge; 2 nodes expected)" in said and "giving up after 600 s" in said, said
    assert [line for line in rest if "Ctrl-C" in line][0].startswith(
        "meshforge: Ctrl-C: stopped waiting for the other nodes at 127.0.0.1:"), rest

    rc, err = _lines(gives_up, 240)
    waiting = [line for line in err if line.startswith("meshforge: waiting for the other nodes at 127.0.0.1:")]
    assert waiting and "(c10d rendezvous, id meshforge; 1 of 2 nodes joined)" in waiting[0], err
    assert "giving up after 3 s (distributed.rendezvous_timeout_s); Ctrl-C stops waiting" in waiting[0]
    errors = [line for line in err if line.startswith("error:")]
    assert rc == 4 and len(errors) == 1, (rc, err)
    assert "the other nodes never came to 127.0.0.1:" in errors[0] and "1 of 2 nodes joined) within 3 s" in errors[0]
    assert not any("Traceback" in line for line in err), err
