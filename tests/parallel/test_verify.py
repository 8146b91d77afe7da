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


def test_a_broken_or_clashing_plugin_is_one_line_not_a_traceback(tmp_path):
    info = tmp_path / "broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (tmp_path / "broken_strategy.py").write_text("raise RuntimeError('the plugin is broken')\n")
    (tmp_path / "clash_strategy.py").write_text(
        "from meshforge.config.strategies import StrategySpec\nSPEC = StrategySpec(name='ddp', runtime='x:Y')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for only in ("broken", "clash"):
        (info / "entry_points.txt").write_text(f"[meshforge.strategies]\n{only} = {only}_strategy:SPEC\n")
        proc = subprocess.run([sys.executable, "-m", "meshforge", "validate", "examples/tiny_cpu.yaml"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"strategy plugin {only} (entry point meshforge.strategies" in lines[0], lines
        assert ("the plugin is broken" if only == "broken" else "the name 'ddp' is taken") in lines[0]


@pytest.mark.slow
def test_verify_every_strategy_on_two_processes():
    proc = meshforge("verify", "--nproc-per-node", "2", "--steps", "3")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    expected = BUILT_IN + ["allreduce_dp"]
    assert len(lines) == len(expected) >= 4, lines
    for strategy, line in zip(expected, lines):
        assert line.startswith(strategy) and "PASS" in line and "last loss" in line
