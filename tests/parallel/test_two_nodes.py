"""Two "nodes" on this machine: two `meshforge train --nnodes 2 --node-rank R --rdzv-endpoint 127.0.0.1:PORT
--nproc-per-node 2` launchers (torch's static rendezvous, node 0's agent serving the store), four fsdp2
ranks in all, must reproduce the single-process run: per-step loss within 1e-5 relative and grad norm
within 1e-4 (the same tolerances as tests/parallel/test_dp_parity.py), read from rank 0's metrics.jsonl.
The run's metadata must say 2 nodes and world size 4. This test pays for its own launch (two agents)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from meshforge.config import load_config
from meshforge.config.loader import write_yaml
from meshforge.launch import LAUNCH_VARS
from meshforge.testing.parity import RunResult, base_overrides, compare

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_match_one_process(tmp_path, reference):
    out = tmp_path / "run"
    cfg = load_config(None, base_overrides(10), world_size=4)
    write_yaml(cfg, tmp_path / "cfg.yaml")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "meshforge", "train", str(tmp_path / "cfg.yaml"), f"run.output_dir={out}",
         "logging.loggers=[jsonl]", "logging.log_every=1", "--nnodes", "2", "--node-rank", str(r),
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        for r in (0, 1)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {r} exited {p.returncode}:\n{text[-4000:]}"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    got = RunResult([r["loss"] for r in recs], [r["grad_norm"] for r in recs])
    compare(reference(), got, "two nodes x 2 processes (fsdp2)", 1e-5)
    meta = json.loads((out / "run_meta.json").read_text())["meta"]
    assert (meta["world_size"], meta["nnodes"]) == (4, 2)
