"""`meshforge verify --nproc-per-node 2`: one line per strategy, each a real short training run through
`meshforge train --nproc-per-node 2` (torch's elastic launcher), finite last loss."""

import subprocess
import sys

import pytest

from meshforge.verify import available_strategies

pytestmark = pytest.mark.dist


def test_verify_every_strategy_on_two_processes():
    proc = subprocess.run([sys.executable, "-m", "meshforge", "verify", "--nproc-per-node", "2", "--steps", "3"],
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert len(lines) == len(available_strategies()) >= 2
    for strategy, line in zip(available_strategies(), lines):
        assert line.startswith(strategy) and "PASS" in line and "last loss" in line
