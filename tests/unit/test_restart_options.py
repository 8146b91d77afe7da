"""`--max-restarts` / `resilience.max_restarts` (issue 29 item 2): refused before launch with one line each, and
the cause a restarting launcher names (launch.failure_cause), without starting processes."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest

from meshforge import cli
from meshforge.launch import failure_cause

BASE = ["model.preset=tiny", "data.source=synthetic", "training.device=cpu", "logging.progress=none"]


@pytest.mark.parametrize("extra, want", [
    (["--max-restarts", "-1"], "resilience.max_restarts"),
    (["--max-restarts", "2", "checkpoint.resume=none"], "set checkpoint.resume=auto"),
    (["resilience.max_restarts=lots"], "resilience.max_restarts"),
])
def test_bad_restart_options_are_one_line_exit_2(tmp_path, capsys, extra, want):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    assert cli.main(["train", str(cfg), *BASE, f"run.output_dir={tmp_path}/run", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], err
    assert not (tmp_path / "run").exists()


def test_restarts_under_torchrun_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: r}\n")
    assert cli.main(["train", str(cfg), *BASE, "--max-restarts", "1"]) == 2
    assert "needs meshforge's launcher" in capsys.readouterr().err


def test_the_cause_is_a_rank_s_own_line_before_a_signal_before_a_peer_s(tmp_path):
    died = {0: SimpleNamespace(exitcode=-int(signal.SIGTERM)), 1: SimpleNamespace(exitcode=-int(signal.SIGKILL)),
            2: SimpleNamespace(exitcode=1)}
    assert failure_cause(died, tmp_path) == "rank 1 was killed by SIGKILL"  # SIGTERM: the agent's own
    (tmp_path / "rank2.json").write_text(json.dumps({"line": "lost its peer", "secondary": True}))
    assert failure_cause(died, tmp_path) == "rank 1 was killed by SIGKILL"
    (tmp_path / "rank3.json").write_text(json.dumps({"line": "checkpoint.dir=/x is not writable", "secondary": False}))
    assert failure_cause(died, tmp_path) == "rank 3: checkpoint.dir=/x is not writable"
