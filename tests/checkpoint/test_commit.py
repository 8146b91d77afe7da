"""Commit protocol, retention, verification errors (exit 2, one line), inspect, non-finite handling: one process."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from meshforge.checkpoint.manifest import file_entry
from meshforge.checkpoint.paths import complete_checkpoints, read_latest
from meshforge.checkpoint.manager import CheckpointManager
from meshforge.cli import main as cli_main
from meshforge.errors import CheckpointError, TrainingStopped
from meshforge.testing.parity import base_overrides, config, single_info
from meshforge.training.trainer import train

STEPS = 8


def _train(overrides, steps=STEPS, fault=None):
    old = os.environ.pop("MESHFORGE_FAULT", None)
    if fault:
        os.environ["MESHFORGE_FAULT"] = fault
    try:
        return train(config(overrides, steps), single_info())
    finally:
        os.environ.pop("MESHFORGE_FAULT", None)
        if old is not None:
            os.environ["MESHFORGE_FAULT"] = old


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8-step schedule; saves every 2 steps keeping 3; a real SIGUSR1 after step 6 stops it with a save."""
    tmp = tmp_path_factory.mktemp("commit")
    out = tmp / "run"
    res = _train([f"run.output_dir={out}", "checkpoint.interval=2", "checkpoint.keep_last=3"],
                 fault="signal_at_step:6:0:USR1")
    full = _train([f"run.output_dir={tmp}/full"])
    cfg = tmp / "cfg.yaml"
    cfg.write_text("run:\n  name: t\n")
    return SimpleNamespace(tmp=tmp, out=out, ck=out / "checkpoints", res=res, full=full, cfg=cfg)


def _cli_train(run, overrides, capsys):
    capsys.readouterr()
    rc = cli_main(["train", str(run.cfg), *base_overrides(STEPS), *overrides])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_layout_manifest_and_latest(run):
    assert run.res.stopped_by_signal and run.res.final_step == 6
    names = sorted(p.name for p in run.ck.iterdir())
    assert names == ["LATEST", "step_2", "step_4", "step_6"], names
    assert read_latest(run.ck).name == "step_6"
    m = json.loads((run.ck / "step_6" / "manifest.json").read_text())
    assert m["step"] == 6 and m["world_size"] == 1 and m["strategy"] and len(m["config_digest"]) == 64
    assert m["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    on_disk = {p.name for p in (run.ck / "step_6").iterdir()} - {"manifest.json"}
    assert set(m["files"]) == on_disk and {".metadata", "trainer_state_rank0.pt"} <= on_disk
    for name, entry in m["files"].items():
        assert file_entry(run.ck / "step_6" / name) == entry
    ts = torch.load(run.ck / "step_6" / "trainer_state_rank0.pt", weights_only=True)  # no pickle needed
    assert ts["step"] == 6 and ts["loader"]["step"] == 6 and set(ts["rng"]) >= {"torch", "numpy", "python"}


def test_resume_exact_and_partial_cleanup(run, capsys):
    # a leftover of an interrupted save, and a stale LATEST.tmp
    junk = run.ck / "step_8.partial"
    junk.mkdir()
    (junk / "__0_0.distcp").write_bytes(b"half a shard")
    (run.ck / "LATEST.tmp").write_text("step_8\n")
    capsys.readouterr()
    res = _train([f"run.output_dir={run.out}", "checkpoint.resume=auto"])
    out = capsys.readouterr().out
    assert "removed leftover step_8.partial" in out
    assert not junk.exists() and not (run.ck / "LATEST.tmp").exists()
    assert res.start_step == 6 and res.losses == run.full.losses[6:]  # bitwise


def _copy(run, name):
    dst = run.tmp / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(run.ck / "step_4", dst)
    return dst


@pytest.mark.parametrize("fault", ["truncated", "missing", "checksum", "manifest"])
def test_damaged_checkpoint_exit2_one_line(run, capsys, fault):
    d = _copy(run, f"bad_{fault}")
    if fault == "truncated":
        f = d / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:1000])
        want = "__0_0.distcp: truncated or altered (1000 bytes"
    elif fault == "missing":
        (d / "trainer_state_rank0.pt").unlink()
        want = "trainer_state_rank0.pt: missing (listed in manifest.json)"
    elif fault == "checksum":
        f = d / ".metadata"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
        want = ".metadata: checksum mismatch"
    else:
        (d / "manifest.json").unlink()
        want = "manifest.json: missing (not a complete meshforge checkpoint)"
    rc, _out, err = _cli_train(run, [f"run.output_dir={run.tmp}/o_{fault}", f"checkpoint.resume={d}"], capsys)
    lines = err.strip().splitlines()
    print(lines)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], (rc, lines)
    rc = cli_main(["checkpoint", "inspect", str(d)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and want in err[0]


def test_other_model_shape_exit2_names_parameter(run, capsys):
    rc, _out, err = _cli_train(run, [f"run.output_dir={run.tmp}/o_shape", f"checkpoint.resume={run.ck}/step_4",
                                    "model.ffn_dim=128"], capsys)
    lines = err.strip().splitlines()
    print(lines)
    assert rc == 2 and len(lines) == 1
    assert "parameter layers.0.feed_forward.w1.weight has shape (176, 64) in the checkpoint but (128, 64)" in lines[0]


def test_auto_fallback_to_previous(run, capsys):
    root = run.tmp / "fb"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(run.out, root)
    f = root / "checkpoints" / "step_6" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-10])
    capsys.readouterr()
    res = _train([f"run.output_dir={root}", "checkpoint.resume=auto"])
    err = capsys.readouterr().err
    assert "truncated or altered" in err and "falling back to the previous complete checkpoint step_4" in err
    assert res.start_step == 4 and res.losses == run.full.losses[4:]


def test_retention_never_deletes_latest(tmp_path):
    for n in (1, 2, 3, 4):
        (tmp_path / f"step_{n}").mkdir()
        (tmp_path / f"step_{n}" / "manifest.json").write_text("{}")
    (tmp_path / "LATEST").write_text("step_1\n")  # e.g. a resume from an older one
    mgr = object.__new__(CheckpointManager)
    mgr.root, mgr.cfg = tmp_path, SimpleNamespace(checkpoint=SimpleNamespace(keep_last=2))
    mgr._retention()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_4", "step_3", "step_1"]


def test_inspect_prints_manifest(run, capsys):
    capsys.readouterr()
    assert cli_main(["checkpoint", "inspect", str(run.out)]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "step            6" in out and "sizes and sha256 OK" in out
    assert "layers.1.attention.wq.weight" in out and "(64, 64)" in out and "world           1" in out
    capsys.readouterr()
    assert cli_main(["checkpoint", "inspect", str(run.ck / "step_6"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6


def test_nonfinite_skip(tmp_path):
    res = _train([f"run.output_dir={tmp_path}/s", "training.nonfinite=skip"], steps=6, fault="nan_at_step:3")
    assert res.skipped_steps == 1 and res.final_step == 6
    assert res.losses[2] != res.losses[2]  # NaN logged for step 3
    w = res.parallel_model.full_state_dict()
    assert all(torch.isfinite(t).all() for t in w.values())  # NaN gradients were never applied


def test_nonfinite_skip_limit_and_stop(run, capsys, tmp_path):
    with pytest.raises(TrainingStopped, match="1 non-finite steps in a row up to step 3"):
        _train([f"run.output_dir={tmp_path}/l", "training.nonfinite=skip", "training.max_skipped=1"], steps=6,
               fault="nan_at_step:3")
    os.environ["MESHFORGE_FAULT"] = "nan_at_step:3"
    try:
        rc, _out, err = _cli_train(run, [f"run.output_dir={tmp_path}/st", "training.nonfinite=stop",
                                        "checkpoint.interval=1"], capsys)
    finally:
        os.environ.pop("MESHFORGE_FAULT")
    print(err)
    assert rc == 3 and "non-finite loss at step 3" in err
    ck = tmp_path / "st" / "checkpoints"
    assert read_latest(ck).name == "step_2" and not (ck / "step_3").exists()  # nothing saved for the bad step


def test_weights_only_resume_never_unpickles(run, tmp_path):
    """trainer_state files are loaded with weights_only=True: a pickle with code in it is refused."""
    d = tmp_path / "evil"
    shutil.copytree(run.ck / "step_4", d)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, d / "trainer_state_rank0.pt")
    m = json.loads((d / "manifest.json").read_text())
    m["files"]["trainer_state_rank0.pt"] = file_entry(d / "trainer_state_rank0.pt")  # a "valid" manifest
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"trainer_state_rank0.pt: refused by torch.load\(weights_only=True\)"):
        _train([f"run.output_dir={tmp_path}/o", f"checkpoint.resume={d}"])
    assert not (tmp_path / "pwned").exists()
