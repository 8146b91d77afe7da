"""`meshforge verify --nproc-per-node 2`: one line per registered strategy, each a real short training run (all of
them in one launch of 2 processes), finite last loss.

It runs with `tests/plugin` on PYTHONPATH: a strategy added from outside meshforge (one module and one entry
point, `meshforge_allreduce_dp.py`) appears in `validate` and `verify` without any edit to meshforge
(`test_bench_sweep.py` benches it too).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.config.strategies import strategy_specs

pytestmark = pytest.mark.dist
PLUGIN = Path(__file__).resolve().parents[1] / "plugin"
BUILT_IN = list(strategy_specs())


def plugin_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)}


def meshforge(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshforge", *args], capture_output=True, text=True,
                          timeout=timeout, env=plugin_env())


def test_plugin_strategy_validates_like_a_built_in():
    ok = meshforge("validate", "examples/tiny_cpu.yaml", "distributed.strategy=allreduce_dp",
                   "distributed.bucket_numel=4096", "training.micro_batch_size=8", "--world-size", "2")
    assert ok.returncode == 0, ok.stderr
    assert "strategy: allreduce_dp" in ok.stdout and "bucket_numel: 4096" in ok.stdout
    bad = meshforge("validate", "examples/tiny_cpu.yaml", "distributed.strategy=allreduce_dp",
                    "distributed.tp_size=2", "training.micro_batch_size=8", "--world-size", "4")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: distributed.tp_size=2 is not supported by strategy allreduce_dp (plain replicas, gradients "
        "all-reduced in buckets by hand): use strategy fsdp2 or megatron_fsdp"], bad.stderr
    other = meshforge("validate", "examples/tiny_cpu.yaml", "distributed.bucket_numel=4096")
    assert other.returncode == 2
    assert "distributed.bucket_numel belongs to strategy allreduce_dp, not to strategy 'fsdp2'" in other.stderr


@pytest.mark.slow
def test_verify_every_strategy_on_two_processes():
    proc = meshforge("verify", "--nproc-per-node", "2", "--steps", "3")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    expected = BUILT_IN + ["allreduce_dp"]
    assert len(lines) == len(expected) >= 4, lines
    for strategy, line in zip(expected, lines):
        assert line.startswith(strategy) and "PASS" in line and "last loss" in line
