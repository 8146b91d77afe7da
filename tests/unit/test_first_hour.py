"""The first hour of a new user (issue 13): the command line takes flags and overrides in any order, no command
vanishes, resume refuses another model, one run per output directory, nothing overwritten unasked, unwritable
places found at start, files follow the umask, Ctrl-C saves and exits 130, the launcher reports the first
failing rank's own exit code. All in this process (world size 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge import cli
from meshforge.checkpoint.manifest import MANIFEST, file_entry
from meshforge.errors import CheckpointError, ConfigError
from meshforge.launch import first_failure_code
from meshforge.testing.parity import config, single_info
from meshforge.training.rundir import LOCK
from meshforge.training.trainer import train


def _train(overrides: list[str], steps: int = 2):
    return train(config(overrides, steps), single_info())


# ------------------------------------------------------------------------------ command line
@pytest.mark.parametrize("argv, overrides", [
    (["train", "c.yaml", "--nproc-per-node", "2", "distributed.strategy=fsdp2"], ["distributed.strategy=fsdp2"]),
    (["train", "c.yaml", "a.b=1", "--nproc-per-node", "2", "c.d=2"], ["a.b=1", "c.d=2"]),
    (["validate", "c.yaml", "training.max_steps=50", "--world-size", "8", "x.y=z"], ["training.max_steps=50", "x.y=z"]),
    (["validate", "c.yaml", "--world-size", "8", "training.max_steps=50"], ["training.max_steps=50"]),
    (["bench", "c.yaml", "--steps", "2", "data.source=synthetic", "--nproc-per-node", "2", "a=b"],
     ["data.source=synthetic", "a=b"]),
])
def test_flags_and_overrides_in_any_order(argv, overrides):
    args = cli.parse_args(cli.build_parser(), argv)
    assert args.overrides == overrides and args.config == "c.yaml"


@pytest.mark.parametrize("argv", [["verify", "--nproc-per-node", "2", "a=b"], ["train", "c.yaml", "--bogus"],
                                  ["checkpoint", "inspect", "d", "a=b"], ["train", "c.yaml", "--nproc-per-node", "0"],
                                  ["validate", "c.yaml", "--world-size", "-2"], ["verify", "--steps", "0"]])
def test_unknown_words_are_still_errors(argv, capsys):
    with pytest.raises(SystemExit) as err:
        cli.parse_args(cli.build_parser(), argv)
    text = capsys.readouterr().err
    assert err.value.code == 2 and ("unrecognized arguments" in text or "is not a positive whole number" in text)


def test_every_registered_command_is_in_help_and_imports():
    import importlib

    text = cli.build_parser().format_help()
    for name, (module, _help) in cli.SUBCOMMANDS.items():
        importlib.import_module(module)  # a registered command whose module is missing fails here, loudly
        assert name in text and "BROKEN" not in text


def test_a_command_whose_module_fails_to_import_stays_and_says_why(monkeypatch, capsys):
    monkeypatch.setitem(cli.SUBCOMMANDS, "ghost", ("meshforge.no_such_module", "a command that is not there"))
    assert "ghost" in cli.build_parser().format_help()
    assert cli.main(["ghost", "x", "--y"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "meshforge ghost is broken: meshforge.no_such_module fails to import" in err[0]


def test_bridge_checkpoint_save_and_load_work_in_yaml(tmp_path):
    from meshforge.config import load_config

    f = tmp_path / "c.yaml"
    f.write_text(f"checkpoint: {{save: {tmp_path}/ck, load: {tmp_path}/old}}\n")
    cfg = load_config(f)
    assert cfg.checkpoint.dir == f"{tmp_path}/ck" and cfg.checkpoint.resume == f"{tmp_path}/old"
    assert load_config(f, ["checkpoint.load=none"]).checkpoint.resume is None


def test_second_ctrl_c_aborts_at_once_but_a_forwarded_one_does_not(monkeypatch):
    from meshforge.training import signals as S

    stop, calls, now = S.StopSignal(1), [], [100.0]
    monkeypatch.setattr(S.os, "kill", lambda pid, sig: calls.append(sig))
    monkeypatch.setattr(S.signal, "signal", lambda sig, handler: calls.append((sig, handler)))
    monkeypatch.setattr(S.time, "monotonic", lambda: now[0])
    stop._handle(signal.SIGINT, None)
    assert stop.requested == signal.SIGINT and not calls and stop.poll() and stop.received == "SIGINT"
    now[0] = 100.5  # the launcher forwarding the same Ctrl-C
    stop._handle(signal.SIGINT, None)
    assert not calls
    now[0] = 104.0  # the user pressing it again
    stop._handle(signal.SIGINT, None)
    assert calls == [(signal.SIGINT, signal.SIG_DFL), signal.SIGINT]


def test_launcher_reports_the_first_failing_ranks_own_code():
    class F:
        def __init__(self, code, ts):
            self.exitcode, self.timestamp = code, ts

    # rank 1 exited 2 (bad input); the launcher then killed rank 0 (SIGTERM, -15)
    assert first_failure_code({0: F(-15, 11), 1: F(2, 10)}) == 2
    assert first_failure_code({0: F(3, 10), 1: F(-9, 10), 2: F(2, 12)}) == 3
    assert first_failure_code({0: F(-9, 10)}) == 1


# ---------------------------------------------------------------------------- resume safety
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-layer tiny run with a final checkpoint."""
    out = tmp_path_factory.mktemp("saved")
    _train([f"run.output_dir={out}", "checkpoint.save_final=true"])
    return out / "checkpoints"


def test_resume_refuses_a_model_with_fewer_layers(saved, tmp_path):
    with pytest.raises(CheckpointError, match=r"saved from another model \(in the checkpoint but not in this model: "
                                              r"layers\.1\."):
        _train([f"run.output_dir={tmp_path}", f"checkpoint.resume={saved}", "model.n_layers=1"])


def test_resume_refuses_other_model_args_with_the_same_tensors(saved, tmp_path):
    with pytest.raises(CheckpointError, match="rope_theta"):
        _train([f"run.output_dir={tmp_path}", f"checkpoint.resume={saved}", "model.rope_theta=500000"])


def test_resume_requires_the_exact_tensor_names(saved, tmp_path):
    """Even without model args in the manifest, an extra tensor in the checkpoint is named."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    step = ck / (saved / "LATEST").read_text().strip()
    m = json.loads((step / MANIFEST).read_text())
    del m["model_args"]
    (step / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in this model: layers\.1\."):
        _train([f"run.output_dir={tmp_path}/o", f"checkpoint.resume={ck}", "model.n_layers=1"])


def test_allow_partial_load_loads_the_common_tensors_from_step_0(saved, tmp_path):
    res = _train([f"run.output_dir={tmp_path}", f"checkpoint.resume={saved}", "model.n_layers=1",
                  "checkpoint.allow_partial_load=true"])
    assert res.start_step == 0 and res.final_step == 2
    import torch

    from meshforge.checkpoint.safe_dcp import dcp_load

    ours = res.parallel_model.full_state_dict()
    want = {"model.tok_embeddings.weight": torch.empty_like(ours["tok_embeddings.weight"])}
    dcp_load(want, saved / (saved / "LATEST").read_text().strip(), no_dist=True)
    assert not torch.equal(want["model.tok_embeddings.weight"], torch.zeros_like(ours["tok_embeddings.weight"]))


def test_a_crafted_non_tensor_item_runs_no_code(tmp_path):
    """DCP reads non-tensor items (optimizer param groups) with torch.load(weights_only=False): not ours."""
    import torch.distributed.checkpoint as dcp

    from meshforge.checkpoint.safe_dcp import dcp_load

    pwned = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {pwned}",))

    dcp.save({"item": Evil(), "ok": {"lr": 0.1, "betas": (0.9, 0.95)}}, checkpoint_id=str(tmp_path / "ck"),
             no_dist=True)
    with pytest.raises(CheckpointError, match="checkpoint item item: refused by torch.load"):
        dcp_load({"item": None}, tmp_path / "ck", no_dist=True)
    assert not pwned.exists()
    state = {"ok": {"lr": 0.0, "betas": None}}
    dcp_load(state, tmp_path / "ck", no_dist=True)
    assert state["ok"] == {"lr": 0.1, "betas": (0.9, 0.95)}


def test_same_model_resumes(saved, tmp_path):
    res = _train([f"run.output_dir={tmp_path}", f"checkpoint.resume={saved}"], steps=3)
    assert res.start_step == 2 and res.final_step == 3


# ------------------------------------------------------------------------------ run directory
def test_a_second_run_into_the_same_directory_fails(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started_utc": "x"}))
    with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {os.getpid()} on"):
        _train([f"run.output_dir={out}", "logging.jsonl=true"])
    assert not (out / "metrics.jsonl").exists() and (out / LOCK).exists()


def test_a_checkpoint_dir_of_its_own_is_locked_too(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started_utc": "x"}))
    with pytest.raises(ConfigError, match=rf"{ck} is in use by another run"):
        _train([f"run.output_dir={tmp_path}/run", f"checkpoint.dir={ck}", "checkpoint.interval=1"])
    assert not (tmp_path / "run" / LOCK).exists(), "the lock taken before the refusal is released"


def test_a_stale_lock_is_taken_over_and_released(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / LOCK).write_text(json.dumps({"pid": gone.pid, "host": os.uname().nodename, "started_utc": "x"}))
    _train([f"run.output_dir={out}", "logging.jsonl=true"])
    assert f"took over a stale lock of process {gone.pid}" in capsys.readouterr().out
    assert (out / "metrics.jsonl").exists() and not (out / LOCK).exists()


def test_a_fresh_run_refuses_to_overwrite_a_run_unless_asked(saved, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(saved.parent, out)
    before = {p.relative_to(out): file_entry(p) for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="holds a run .* checkpoint.resume=none would overwrite it"):
        _train([f"run.output_dir={out}", "checkpoint.interval=1"])  # (base overrides: checkpoint.resume=none)
    assert {p.relative_to(out): file_entry(p) for p in out.rglob("*") if p.is_file()} == before
    _train([f"run.output_dir={out}", "checkpoint.interval=1", "run.overwrite=true"])
    moved = next(tmp_path.glob("run.replaced-*"))
    assert f"moved the previous run in {out} aside to {moved}" in capsys.readouterr().out
    assert {p.relative_to(moved): file_entry(p) for p in moved.rglob("*") if p.is_file()} == before
    assert (out / "checkpoints" / "LATEST").read_text().strip() == "step_2"


def test_a_rerun_with_nothing_to_resume_refuses_to_overwrite_the_metrics(tmp_path):
    """resume=auto with no LATEST is a fresh start too: the first run's metrics are not truncated."""
    out = tmp_path / "run"
    _train([f"run.output_dir={out}", "logging.jsonl=true", "checkpoint.resume=auto"])
    before = (out / "metrics.jsonl").read_bytes()
    assert before
    with pytest.raises(ConfigError, match="holds a run .* with no checkpoint to resume"):
        _train([f"run.output_dir={out}", "logging.jsonl=true", "checkpoint.resume=auto"])
    assert (out / "metrics.jsonl").read_bytes() == before
    _train([f"run.output_dir={tmp_path / 'saving'}", "logging.jsonl=true", "checkpoint.save_final=true",
            "checkpoint.resume=auto"])
    r = _train([f"run.output_dir={tmp_path / 'saving'}", "logging.jsonl=true", "checkpoint.save_final=true",
                "checkpoint.resume=auto"])  # a run that saved: the same command resumes it (and is done at once)
    assert r.start_step == r.final_step == 2


@pytest.mark.parametrize("key", ["run.output_dir", "checkpoint.dir"])
def test_unwritable_places_are_one_line_before_training(key, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = blocker / "sub"  # below a file: no user can create it (a read-only dir would not stop root)
    over = [f"run.output_dir={tmp_path}/run", f"checkpoint.dir={tmp_path}/ck", "checkpoint.interval=1", f"{key}={bad}"]
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("run: {name: x}\n")
    from meshforge.testing.parity import base_overrides

    assert cli.main(["train", str(cfg_file), *base_overrides(2), *over]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{key}={bad} is not writable" in err[0]


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        _train([f"run.output_dir={tmp_path}/run", "checkpoint.save_final=true", "checkpoint.save_consolidated=final",
                "logging.jsonl=true"])
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files) and any(p.name == "metrics.jsonl" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {"0o664"}, modes


# ------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_finishes_the_step_saves_and_exits_130(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MESHFORGE_FAULT", "signal_at_step:2:0:INT")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("run: {name: x}\n")
    from meshforge.testing.parity import base_overrides

    before = signal.getsignal(signal.SIGINT)
    rc = cli.main(["train", str(cfg_file), *base_overrides(5), f"run.output_dir={tmp_path}/run"])
    captured = capsys.readouterr()
    assert rc == 130, captured.err
    assert "Traceback" not in captured.err and "KeyboardInterrupt" not in captured.err
    assert "interrupted (Ctrl-C) at step 2: saved, exiting 130" in captured.err
    assert (tmp_path / "run" / "checkpoints" / "LATEST").read_text().strip() == "step_2"
    assert signal.getsignal(signal.SIGINT) is before


# ------------------------------------------------------------------- environment faults at start-up (issue 26)
@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "abc"}, "RANK='abc' must be a whole number >= 0"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' must be a whole number >= 1"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is outside WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be 1..65535"),
])
def test_launcher_variables_that_cannot_be_right_are_one_line(env, fragment, tmp_path, capsys, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["train", "examples/tiny_cpu.yaml", f"run.output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


@pytest.fixture
def taken_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_rendezvous_port_in_use_is_one_line(taken_port, tmp_path, capsys):
    rc = cli.main(["train", "examples/tiny_cpu.yaml", "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0",
                   "--rdzv-endpoint", f"127.0.0.1:{taken_port}", f"run.output_dir={tmp_path}/run"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1 and f"127.0.0.1:{taken_port}: its port is in use" in err[0], err


def test_a_master_port_in_use_is_one_line(taken_port, tmp_path, capsys, monkeypatch):
    """A rank started by torchrun or srun whose MASTER_PORT another process holds (rank 0 serves the store)."""
    import meshforge.launch

    monkeypatch.setattr(meshforge.launch, "stop_with_launcher", lambda: None)  # this test process has no launcher
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(taken_port)}.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["train", "examples/tiny_cpu.yaml", f"run.output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"MASTER_PORT=127.0.0.1:{taken_port}: the port is in use" in err[0], err
