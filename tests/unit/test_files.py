"""What meshforge never does to your files (issue 26; docs/files.md names each guarantee and its test here):
outputs go only where nothing of anyone else's is destroyed, one run per run directory and checkpoints folder,
a resume never trains on changed data unasked, no run trains on nothing, and the metrics timeline has no
repeated step. In this process (world size 1); the launcher's own guarantees: tests/functional/test_lifeline.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshforge.outputs as outputs
from meshforge.cli import main
from meshforge.config.schema import DataConfig
from meshforge.data import batch_loader, build_source
from meshforge.data.sources import split_validation
from meshforge.errors import ConfigError, DataError
from meshforge.testing.parity import base_overrides, config, single_info
from meshforge.training import rundir
from meshforge.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]


def _train(overrides: list[str], steps: int = 2):
    return train(config(overrides, steps), single_info())


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root`."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return rc, [ln for ln in err.splitlines() if ln.startswith("error:")]


# ------------------------------------------------------------------------- the rule for output folders
def test_an_output_folder_is_new_its_own_kind_or_refused(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "LATEST").write_text("step_2\n")
    outputs.mark(run, outputs.RUN)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    outputs.mark(earlier, "export")
    (tmp_path / "link").symlink_to(run)

    def check(path, sources=()):
        return outputs.check_folder(path, "export", "--to", sources=sources)

    assert check(tmp_path / "new") is None and check(earlier) is None
    (tmp_path / "empty").mkdir()
    assert check(tmp_path / "empty") is None
    refused = {
        mine: "holds files meshforge did not write (notes.txt)",
        run: "is a meshforge run directory",
        run / "checkpoints": "is inside the run directory",
        tmp_path / "link" / "checkpoints" / "x": "is inside",  # a symlink spelling resolves to the same place
        run / "sub" / ".." / "checkpoints": "is inside the run directory",
        Path("."): "is the working directory",
        work.parent: "is the home folder",
        tmp_path: "holds the home folder",
        Path("/"): "is the filesystem root",
        mine / "out": None,  # inside a user's folder, but new: fine
    }
    for path, fragment in refused.items():
        problem = check(path)
        assert (problem is None) if fragment is None else fragment in (problem or ""), (path, problem)
    assert "holds this command's own input" in check(tmp_path / "new", sources=[tmp_path / "new" / "in.txt"])


REPLACE = """
import importlib.util, os, shutil, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("outputs", sys.argv[3])  # the module alone: no package import
o = importlib.util.module_from_spec(spec)
spec.loader.exec_module(o)
dest, point = Path(sys.argv[1]), sys.argv[2]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if point == "publish":
    o._exchange = die
elif point == "swap-fallback":  # a filesystem without RENAME_EXCHANGE, killed between its two renames
    o._exchange = lambda a, b: False
    real = os.rename
    o.os.rename = lambda a, b: real(a, b) if Path(a) != dest else (real(a, b), die())
elif point == "delete":  # after the swap, while the old output is deleted
    o.shutil.rmtree = lambda p, **k: die() if Path(p).exists() else None
def write(folder):
    for i in range(20):
        (folder / f"shard{i}").write_text("new" * 100)
        if point == "write" and i == 10:
            die()
    return 0
o.replace_folder(dest, "export", write)
"""


@pytest.mark.parametrize("point", ["write", "publish", "swap-fallback", "delete"])
def test_a_kill_during_a_replacement_leaves_the_old_or_the_new_output_whole(tmp_path, point):
    dest = tmp_path / "export"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    outputs.mark(dest, "export")
    old = snapshot(dest)
    new = {**{f"shard{i}": hashlib.sha256(b"new" * 100).hexdigest() for i in range(20)},
           outputs.MARKER: None}
    proc = subprocess.run([sys.executable, "-c", REPLACE, str(dest), point, outputs.__file__], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr[-2000:]
    if point in ("write", "publish"):
        assert snapshot(dest) == old
    elif point == "delete":
        got = snapshot(dest)
        assert set(got) == set(new) and all(got[k] == v for k, v in new.items() if v)
    else:  # between the two renames: the old output is whole under its hidden name until the next call
        assert not dest.exists()
    outputs.recover(dest)  # what the next replacement (or export) does first
    assert dest.is_dir() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert snapshot(dest) == old if point != "delete" else set(snapshot(dest)) == set(new)


# ----------------------------------------------------------------------------------- run directories
def _hold(out: Path, *overrides: str) -> rundir.RunDir:
    """Run A, still running: this process holds its claim (locks) on `out`."""
    return rundir.claim(config([f"run.output_dir={out}", "checkpoint.interval=1", *overrides]), single_info())


def test_a_second_run_never_writes_into_a_running_runs_checkpoints(tmp_path):
    a, shared = tmp_path / "a", tmp_path / "shared_ck"
    held = [_hold(a), _hold(tmp_path / "a2", f"checkpoint.dir={shared}")]
    (tmp_path / "link").symlink_to(tmp_path)
    try:
        before = snapshot(tmp_path)
        for spelling in [a / "checkpoints", tmp_path / "link" / "a" / "checkpoints", a / "x" / ".." / "checkpoints",
                         shared, tmp_path / "link" / "shared_ck", a]:
            with pytest.raises(ConfigError, match="is in use by another run|is inside the run directory|is a "
                                                  "meshforge run"):
                _train([f"run.output_dir={tmp_path / 'b'}", f"checkpoint.dir={spelling}", "checkpoint.interval=1"])
        assert snapshot(tmp_path) == before
    finally:
        for h in held:
            h.release()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run directory with metrics and checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished") / "run"
    _train([f"run.output_dir={out}", "checkpoint.interval=2", "logging.loggers=[jsonl]", "logging.log_every=1"],
           steps=4)
    return out


def test_a_step_0_start_from_a_weights_only_checkpoint_is_a_fresh_run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    weights = tmp_path / "weights_only"
    shutil.copytree(finished / "checkpoints" / "step_2", weights)
    m = json.loads((weights / "manifest.json").read_text())
    m["contents"] = ["model"]  # what `checkpoint import` writes: weights, no optimizer state
    (weights / "manifest.json").write_text(json.dumps(m))
    before = snapshot(out)
    with pytest.raises(ConfigError, match=r"holds a run .* starts a new run at step 0"):
        _train([f"run.output_dir={out}", f"checkpoint.resume={weights}", "checkpoint.interval=2",
                "logging.loggers=[jsonl]"], steps=4)
    assert snapshot(out) == before
    res = _train([f"run.output_dir={tmp_path / 'fresh'}", f"checkpoint.resume={weights}", "checkpoint.interval=2"])
    assert res.start_step == 0 and (tmp_path / "fresh" / "config.yaml").is_file()


def test_a_run_directory_of_someone_elses_files_is_refused_or_moved_aside(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"run.output_dir=.* holds files meshforge did not write \(notes.txt\)"):
        _train([f"run.output_dir={out}", "logging.loggers=[jsonl]"])
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"keep me").hexdigest()}
    _train([f"run.output_dir={out}", "logging.loggers=[jsonl]", "run.overwrite=true"])
    aside = next(tmp_path.glob("mine.replaced-*"))
    assert (aside / "notes.txt").read_text() == "keep me" and not (out / "notes.txt").exists()


def test_another_ranks_write_test_in_flight_is_not_someone_elses_file(tmp_path):
    """Every rank probes checkpoint.dir while rank 0 looks at run.output_dir: a probe seen there mid-flight made a
    fresh 4-rank run refuse its own new folder ("holds files meshforge did not write"), now and then under load."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / ".meshforge-write-test.node7.4242.3").write_bytes(b"")  # rank 3's, caught before its unlink
    assert not outputs.is_foreign(out)
    assert _train([f"run.output_dir={out}", "logging.loggers=[jsonl]"]).final_step == 2
    assert outputs.kind_of(out) == outputs.RUN


@pytest.mark.parametrize("where", ["working directory", "home folder", "inside another run"])
def test_a_run_never_writes_into_home_the_working_directory_or_another_run(where, finished, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    out = {"working directory": ".", "home folder": str(home), "inside another run": finished / "sub"}[where]
    before = snapshot(finished)
    with pytest.raises(ConfigError, match=f"is the {where}|is inside the run directory"):
        _train([f"run.output_dir={out}", "logging.loggers=[jsonl]"])
    assert snapshot(home) == {} and snapshot(finished) == before


def test_a_start_that_cannot_write_is_one_line(tmp_path, monkeypatch):
    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "write_yaml", full)
    with pytest.raises(ConfigError, match="cannot write there \\(No space left on device\\)"):
        _train([f"run.output_dir={tmp_path / 'run'}", "logging.loggers=[jsonl]"])


# ------------------------------------------------------------------------------------ metrics timeline
def test_a_resume_drops_the_metrics_of_the_steps_it_redoes(finished, tmp_path):
    """A crash after step 4 whose last commit was step 2: the resumed run logs 3 and 4 again, once."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "checkpoints" / "step_4")
    (out / "checkpoints" / "LATEST").write_text("step_2\n")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0')  # the torn last line of a crash
    _train([f"run.output_dir={out}", "checkpoint.resume=auto", "checkpoint.interval=2", "logging.loggers=[jsonl]",
            "logging.log_every=1"], steps=4)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------- data prepare, plot
def test_data_prepare_replaces_only_its_own_token_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world\n")
    np.save(tmp_path / "theirs.npy", np.arange(5, dtype=np.float64))
    theirs = (tmp_path / "theirs.npy").read_bytes()
    ck = tmp_path / "run" / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "LATEST").write_text("step_1\n")
    for out, fragment in [("theirs.npy", "already holds a file that is not a token file"),
                          (".", "is a folder"), (str(ck / "t.npy"), "is inside the checkpoints folder"),
                          ("a.txt/t.npy", "a.txt is a file, not a folder")]:
        rc, errors = run_cli(["data", "prepare", "a.txt", "-o", out], capsys)
        assert rc == 2 and len(errors) == 1 and fragment in errors[0], (out, errors)
    assert (tmp_path / "theirs.npy").read_bytes() == theirs and not (ck / "t.npy").exists()
    assert run_cli(["data", "prepare", "a.txt", "-o", "tokens.npy"], capsys)[0] == 0
    (tmp_path / "a.txt").write_text("hello again\n")
    assert run_cli(["data", "prepare", "a.txt", "-o", "tokens.npy"], capsys)[0] == 0  # its own kind: replaced
    assert np.load(tmp_path / "tokens.npy").tobytes().decode("utf-16-le") == "hello again\n\0"
    rc, errors = run_cli(["data", "prepare", "*", "-o", "tokens.npy"], capsys)  # the glob takes the output in
    assert rc == 2 and "is one of this command's inputs" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "run", "theirs.npy", "tokens.npy"]


def test_binary_files_are_refused_naming_the_file(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    rc, errors = run_cli(["data", "prepare", tmp_path / "a.txt", tmp_path / "logo.png", "-o", tmp_path / "t.npy"],
                         capsys)
    assert rc == 2 and f"{tmp_path / 'logo.png'} is a binary file" in errors[0]
    assert not (tmp_path / "t.npy").exists()
    with pytest.raises(DataError, match="logo.png is a binary file"):  # training on text reads the same way
        build_source(DataConfig(paths=[str(tmp_path / "*")]), seq_len=4, vocab_size=256, seed=0)


def test_a_utf8_error_names_its_line(tmp_path):
    good = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(1, 201))
    (tmp_path / "d.jsonl").write_bytes(good.encode() + b'{"text": "caf\xe9"}\n')
    (tmp_path / "t.txt").write_bytes(b"ok\n" * 40 + b"bad \xff here\n")
    with pytest.raises(DataError, match=r"d.jsonl is not UTF-8 text \(line 201,"):
        build_source(DataConfig(source="dataset", paths=[str(tmp_path / "d.jsonl")]), 16, 256, 0)
    with pytest.raises(DataError, match=r"t.txt is not UTF-8 text \(line 41,"):
        build_source(DataConfig(paths=[str(tmp_path / "t.txt")]), 16, 256, 0)


@pytest.mark.slow  # matplotlib renders twice: the slowest test of the fast tier otherwise
def test_plot_writes_only_a_png_and_says_when_it_cannot(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = snapshot(run)
    (tmp_path / "blocker").write_text("")
    for out, fragment in [(run / "metrics.jsonl", "is one of this command's inputs"),
                          (run / "config.yaml", "already holds a file that is not a PNG"),
                          (tmp_path / "blocker" / "x.png", "blocker is a file, not a folder"),
                          (run / "checkpoints" / "x.png", "is inside the checkpoints folder"),
                          (tmp_path, "is a folder")]:
        rc, errors = run_cli(["plot", run, "-o", out], capsys)
        assert rc == 2 and len(errors) == 1 and fragment in errors[0], (out, errors)
    assert snapshot(run) == before
    for _ in range(2):  # its own earlier PNG is replaced
        assert run_cli(["plot", run, "-o", tmp_path / "curves.png"], capsys)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "curves.png", "run"]


# ----------------------------------------------------------------------------------------- fingerprints
def _edit_same_size(path: Path, at: int | str) -> None:
    """Change one byte (at an offset, or the last character of a unique piece of text) keeping the size."""
    data = bytearray(path.read_bytes())
    if isinstance(at, str):
        at = data.index(at.encode()) + len(at) - 1
    data[at] = ord("Q") if data[at] != ord("Q") else ord("R")
    path.write_bytes(bytes(data))


def _kinds(tmp_path: Path) -> dict[str, tuple[dict, Path, int | str]]:
    """{kind: (DataConfig fields, the file to change, where)}: each change lies past the first 4,096 tokens and
    keeps the file's size."""
    text = "".join(f"document number {i} says something\n" for i in range(400))  # ~14 KB
    (tmp_path / "corpus.txt").write_text(text)
    (tmp_path / "val.txt").write_text(text[:3000])
    np.save(tmp_path / "tokens.npy", (np.arange(20000) % 250).astype(np.uint16))
    recs = "".join(json.dumps({"text": f"record {i} " * 8}) + "\n" for i in range(200))
    (tmp_path / "recs.jsonl").write_text(recs)
    sft = "".join(json.dumps({"prompt": f"q{i}", "completion": f"answer {i}"}) + "\n" for i in range(300))
    (tmp_path / "sft.jsonl").write_text(sft)
    return {
        "text": (dict(paths=[str(tmp_path / "corpus.txt")]), tmp_path / "corpus.txt", "number 390 "),
        "tokenized": (dict(source="tokenized", path=str(tmp_path / "tokens.npy")), tmp_path / "tokens.npy", 30000),
        "dataset": (dict(source="dataset", paths=[str(tmp_path / "recs.jsonl")]), tmp_path / "recs.jsonl",
                    "record 190 "),
        "streaming": (dict(source="dataset", paths=[str(tmp_path / "recs.jsonl")], streaming=True),
                      tmp_path / "recs.jsonl", "record 190 "),
        "sft": (dict(source="dataset", format="prompt_completion", paths=[str(tmp_path / "sft.jsonl")]),
                tmp_path / "sft.jsonl", "answer 250"),
        "validation": (dict(paths=[str(tmp_path / "corpus.txt")], validation={"paths": [str(tmp_path / "val.txt")]}),
                       tmp_path / "val.txt", "number 80 "),
    }


def _loader(fields: dict, allow: bool = False):
    data = DataConfig(**fields)
    source, _val = split_validation(data, build_source(data, 16, 256, 0), 16, 256, 0)
    return batch_loader(source, 4, 2, 0, 1, 0, allow_changed_inputs=allow)


@pytest.mark.parametrize("kind", ["text", "tokenized", "dataset", "streaming", "sft", "validation"])
def test_a_resume_onto_changed_data_is_refused_naming_the_file(kind, tmp_path):
    fields, changed, at = _kinds(tmp_path)[kind]
    first = _loader(fields)
    first.next_batch()
    state = first.state_dict()
    _loader(fields).load_state_dict(state)  # the same data resumes
    _edit_same_size(changed, at)
    with pytest.raises(ValueError, match=rf"{changed.name} changed since the checkpoint \(content\).*"
                                         "checkpoint.allow_changed_inputs=true"):
        _loader(fields).load_state_dict(state)
    allowed = _loader(fields, allow=True)
    allowed.load_state_dict(state)
    assert allowed.step == 1 and changed.name in allowed.resume_note


def test_a_large_file_is_fingerprinted_by_size_mtime_and_sampled_blocks(tmp_path, monkeypatch):
    from meshforge.data import fingerprint

    monkeypatch.setattr(fingerprint, "FULL_HASH_BYTES", 1 << 16)
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(1 << 20))
    first = fingerprint.file_entry(f)
    assert "sampled_sha256" in first and fingerprint.file_entry(f) == first
    os.utime(f, ns=(1, 1))
    touched = fingerprint.file_entry(f)
    assert touched != first and fingerprint.differences({"x": first}, {"x": touched}) == \
        ["x changed since the checkpoint (modification time)"]
    _edit_same_size(f, 0)  # inside the first sampled block
    os.utime(f, ns=(1, 1))
    assert fingerprint.file_entry(f) != touched


def test_a_training_resume_onto_a_changed_corpus_is_one_line(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("".join(f"line {i} of the corpus\n" for i in range(2000)))
    run = [f"run.output_dir={tmp_path / 'run'}", "data.source=text", f"data.paths=[{tmp_path / 'c.txt'}]",
           "model.vocab_size=256", "checkpoint.save_final=true", "checkpoint.resume=auto"]
    _train(run)
    _edit_same_size(tmp_path / "c.txt", "line 1900 ")
    with pytest.raises(Exception, match=r"c.txt changed since the checkpoint \(content\)") as err:
        _train(run, steps=3)
    assert type(err.value).__name__ == "CheckpointError"
    capsys.readouterr()
    assert _train([*run, "checkpoint.allow_changed_inputs=true"], steps=3).start_step == 2
    assert "warning: resuming on changed data" in capsys.readouterr().out


def test_a_full_run_resumed_onto_another_init_from_is_one_line_naming_both(tmp_path, capsys):
    """A full run's checkpoint records the model.init_from folder it started from; a resume naming another folder
    (a copy: same content), none, or one where the run had none is refused naming both, unless
    checkpoint.allow_changed_inputs=true (then a warning, and the checkpoint's weights)."""
    _train([f"run.output_dir={tmp_path / 'src'}", "checkpoint.save_final=true"])
    assert main(["checkpoint", "export", str(tmp_path / "src"), "--to", str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = (tmp_path / "a").resolve(), (tmp_path / "b").resolve()
    run = [f"run.output_dir={tmp_path / 'run'}", "checkpoint.save_final=true", "checkpoint.resume=auto"]
    _train([*run, f"model.init_from={a}"])
    capsys.readouterr()
    for init, was, now in ((f"model.init_from={b}", a, b), ("model.init_from=null", a, "(unset)")):
        with pytest.raises(Exception, match=re.escape(f"its run started from model.init_from={was}, this run's "
                                                      f"model.init_from is {now}: set model.init_from back")) as err:
            _train([*run, init], steps=3)
        assert type(err.value).__name__ == "CheckpointError" and len(err.value.problems) == 1
    assert main(["train", str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"),
                 *base_overrides(3), "data.max_files=null", *run, f"model.init_from={b}"]) == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and f"model.init_from={a}, this run's model.init_from is {b}" in line
    resumed = _train([*run, f"model.init_from={b}", "checkpoint.allow_changed_inputs=true"], steps=3)
    assert resumed.start_step == 2
    assert "warning: resuming with another model.init_from" in "".join(capsys.readouterr())
    # a run that started from a random init, resumed with an init_from added
    scratch = [f"run.output_dir={tmp_path / 'scratch'}", "checkpoint.save_final=true", "checkpoint.resume=auto"]
    _train(scratch)
    with pytest.raises(Exception, match=re.escape("started from model.init_from=(none: a random init), this "
                                                  f"run's model.init_from is {a}")):
        _train([*scratch, f"model.init_from={a}"], steps=3)


# ------------------------------------------------------------------------------------ training on nothing
def test_sft_that_would_train_on_nothing_is_refused_and_what_is_left_out_is_reported(tmp_path, capsys):
    def jsonl(name, pairs):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
        return str(tmp_path / name)

    long_prompt = [("x" * 40, "yes")] * 20  # every answer starts beyond seq_len + 1 = 17 tokens
    with pytest.raises(DataError, match=r"20 examples .* 20 truncated to 17 tokens, 20 left out \(no answer token "
                                        r"within the first 17 tokens\); 0 remain: none left to train on"):
        build_source(DataConfig(source="dataset", format="prompt_completion", paths=[jsonl("a.jsonl", long_prompt)]),
                     16, 256, 0)
    mostly = [("x" * 40, "no")] * 19 + [("q", "a")]
    with pytest.raises(DataError, match=r"19 dropped .*; 1 remain: too few left to train on \(meshforge refuses "
                                        "fewer than 10%\\)"):
        build_source(DataConfig(source="dataset", format="prompt_completion", too_long="drop",
                                paths=[jsonl("b.jsonl", mostly)]), 16, 256, 0)
    some = [("x" * 40, "no")] * 3 + [("q", "a")] * 7
    path = jsonl("c.jsonl", some)
    res = _train([f"run.output_dir={tmp_path / 'run'}", "data.source=dataset", "data.format=prompt_completion",
                  f"data.paths=[{path}]", "model.vocab_size=256", "training.seq_len=16", "training.global_batch_size=2",
                  "training.micro_batch_size=2"])
    assert res.final_step == 2 and all(loss > 0 for loss in res.losses)
    assert "data: 10 examples in" in capsys.readouterr().out


def test_every_guarantee_in_docs_files_md_names_a_test_that_exists():
    import re

    text = (ROOT / "docs" / "files.md").read_text()
    files = {"tests/unit/test_files.py", *re.findall(r"`(tests/[\w/]+\.py)`", text)}
    defined = {name for f in files for name in re.findall(r"^def (test_\w+)", (ROOT / f).read_text(), re.M)}
    named = set(re.findall(r"`(test_\w+)`", text))
    assert len(named) >= 15 and named <= defined, named - defined


# ------------------------------------------------------------------------------ checkpoint export / import
def _files_of(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_export_to_refuses_every_place_it_would_destroy_and_replaces_its_own(finished, tmp_path, capsys, monkeypatch):
    home, runs = tmp_path / "home", tmp_path / "runs"
    (home / "work").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home / "work")
    run = runs / "run"
    shutil.copytree(finished, run)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = {f: snapshot(f) for f in (run, mine, finished)}
    for to, fragment in [(run, "holds this command's own input"), (run / "checkpoints", "own input"),
                         (run / "sub", "is inside the run directory"), (runs, "holds this command's own input"),
                         (finished, "is a meshforge run directory"), (mine, "holds files meshforge did not write "
                                                                            "(notes.txt)"),
                         (".", "is the working directory"), ("~", "is the home folder"),
                         ("/", "is the filesystem root")]:
        rc, errors = run_cli(["checkpoint", "export", run, "--to", to], capsys)
        assert rc == 2 and len(errors) == 1 and fragment in errors[0], (to, errors)
    assert {f: snapshot(f) for f in before} == before and snapshot(home) == {}
    out = tmp_path / "hf"
    assert run_cli(["checkpoint", "export", run / "checkpoints" / "step_2", "--to", out], capsys)[0] == 0
    (out / "stale.txt").write_text("from the earlier export")
    assert run_cli(["checkpoint", "export", run, "--to", out], capsys)[0] == 0  # its own earlier export: replaced
    assert json.loads((out / outputs.MARKER).read_text())["kind"] == "export" and not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


EXPORT_KILLED = """
import os, signal, sys
import meshforge.outputs as o
import meshforge.checkpoint.hf as hf
from meshforge.cli import main
ck, dest, point = sys.argv[1:]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
real_save = hf.save_file
if point == "write":  # half of the new export's files written
    hf.save_file = lambda t, f, **k: (real_save(t, f, **k), die())
elif point == "publish":
    o._exchange = die
elif point == "delete":  # the new export in place, the old one being deleted
    o.shutil.rmtree = lambda p, **k: die() if os.path.exists(p) else None
main(["checkpoint", "export", ck, "--to", dest])
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write", "publish", "delete"])
def test_a_kill_during_an_export_leaves_the_old_export_or_the_new_one(finished, tmp_path, capsys, point):
    out = tmp_path / "hf"
    assert run_cli(["checkpoint", "export", finished / "checkpoints" / "step_2", "--to", out], capsys)[0] == 0
    old = snapshot(out)
    new_dir = tmp_path / "new"
    assert run_cli(["checkpoint", "export", finished / "checkpoints" / "step_4", "--to", new_dir], capsys)[0] == 0
    new = snapshot(new_dir)
    assert {k: v for k, v in old.items() if k != outputs.MARKER} != {k: v for k, v in new.items()
                                                                      if k != outputs.MARKER}
    proc = subprocess.run([sys.executable, "-c", EXPORT_KILLED, str(finished / "checkpoints" / "step_4"), str(out),
                           point], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == -9, proc.stderr[-2000:]
    got = snapshot(out)
    whole = {k: v for k, v in (old if point != "delete" else new).items() if k != outputs.MARKER}
    assert {k: v for k, v in got.items() if k != outputs.MARKER} == whole
    assert run_cli(["checkpoint", "export", finished, "--to", out], capsys)[0] == 0  # the next export cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "new"]


def test_an_interrupted_consolidated_export_is_finished_or_undone_on_the_next_start(tmp_path):
    from meshforge.checkpoint.paths import remove_leftovers

    hf = tmp_path / "checkpoints" / "hf"
    (hf / ".step_2.old-11").mkdir(parents=True)  # killed between setting step_2 aside and publishing its new export
    (hf / ".step_2.old-11" / "model.safetensors").write_text("old")
    (hf / ".step_2.partial-11").mkdir()
    (hf / "step_4").mkdir()
    (hf / ".step_4.old-12").mkdir()  # killed while deleting the replaced step_4
    removed = remove_leftovers(tmp_path / "checkpoints")
    assert len(removed) == 3 and sorted(p.name for p in hf.iterdir()) == ["step_2", "step_4"]
    assert (hf / "step_2" / "model.safetensors").read_text() == "old"


def test_import_never_moves_a_runs_latest_and_replaces_only_its_own_import(finished, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert run_cli(["checkpoint", "export", finished, "--to", hf], capsys)[0] == 0
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    elsewhere = tmp_path / "ck"  # a run's checkpoint.dir outside its run directory
    shutil.copytree(finished / "checkpoints", elsewhere)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = {f: snapshot(f) for f in (run, elsewhere, mine)}
    for to, fragment in [(run / "checkpoints", "is inside the run directory"), (run, "is a meshforge run directory"),
                         (elsewhere, "is a run's checkpoints folder"), (mine, "holds files meshforge did not write"),
                         (hf, "holds this command's own input")]:
        rc, errors = run_cli(["checkpoint", "import", hf, "--to", to], capsys)
        assert rc == 2 and len(errors) == 1 and fragment in errors[0], (to, errors)
    assert {f: snapshot(f) for f in before} == before
    imp = tmp_path / "imported"
    for _ in range(2):  # new, then its own earlier import: replaced whole
        assert run_cli(["checkpoint", "import", hf, "--to", imp], capsys)[0] == 0
        assert (imp / "LATEST").read_text() == "step_0\n" and (imp / "step_0" / "manifest.json").is_file()
        (imp / "stale.txt").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf", "imported", "mine", "run"]
    res = _train([f"run.output_dir={tmp_path / 'from_import'}", f"checkpoint.resume={imp}"])
    assert res.start_step == 0 and res.final_step == 2


def test_crafted_safetensors_are_one_line_naming_the_file_and_nothing_is_written(tmp_path, capsys):
    crafted = ROOT / "tests" / "corpus" / "bad_inputs" / "crafted_safetensors"
    cases = sorted(crafted.iterdir())
    assert len(cases) >= 11
    for case in cases:
        rc, errors = run_cli(["checkpoint", "import", case, "--to", tmp_path / "ck"], capsys)
        assert rc == 2 and len(errors) == 1 and f"{case / 'model.safetensors'}: not a readable" in errors[0], errors
    index = tmp_path / "indexed"
    shutil.copytree(cases[0], index)
    for weight_map in ['{"weight_map": {"w": "../../etc/passwd"}}', '{"weight_map": []}', "[]", '{"a": 1}', "{"]:
        (index / "model.safetensors.index.json").write_text(weight_map)
        rc, errors = run_cli(["checkpoint", "import", index, "--to", tmp_path / "ck"], capsys)
        assert rc == 2 and len(errors) == 1 and "model.safetensors.index.json: " in errors[0], (weight_map, errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["indexed"]


# ----------------------------------------------------------------------------------- damaged checkpoints
def _rehash(ck: Path, name: str) -> None:
    """Record `name`'s new size and sha256 in the manifest (a crafted file the manifest vouches for)."""
    from meshforge.checkpoint.manifest import file_entry

    m = json.loads((ck / "manifest.json").read_text())
    m["files"][name] = file_entry(ck / name)
    (ck / "manifest.json").write_text(json.dumps(m))


def _manifest_variants(m: dict) -> dict[str, tuple[str, str]]:
    """{name: (manifest.json text, the message fragment)}: wrong types, missing keys, nesting."""
    def edit(**kw):
        return json.dumps({k: v for k, v in {**m, **kw}.items() if v is not None})

    first = sorted(m["files"])[0]
    return {
        "a list": ("[]", "not a manifest (a JSON list, not an object)"),
        "files a list": (edit(files=[]), "key files must be an object"),
        "bytes a string": (edit(files={**m["files"], first: {"bytes": "a", "sha256": "0"}}),
                           f"files.{first} must be an object with bytes"),
        "step missing": (json.dumps({k: v for k, v in m.items() if k != "step"}), "key step is missing"),
        "step a string": (edit(step="4"), "key step must be an integer"),
        "contents a string": (edit(contents="model"), "key contents must be a list"),
        "model_args a list": (edit(model_args=[]), "key model_args must be an object"),
        "model_args.dim a string": (edit(model_args={**m["model_args"], "dim": "x"}), "model_args.dim must be int"),
        "a file outside": (edit(files={**m["files"], "../x": m["files"][first]}), "is not a file name in the"),
        "nested 5000 deep": ('{"files": ' + "[" * 5000 + "]" * 5000 + "}", "unreadable manifest (RecursionError"),
    }


def test_a_manifest_of_the_wrong_types_is_one_line_naming_the_file_and_key(finished, tmp_path, capsys):
    ck = tmp_path / "c" / "step_4"
    shutil.copytree(finished / "checkpoints" / "step_4", ck)
    good = json.loads((ck / "manifest.json").read_text())
    for name, (text, fragment) in _manifest_variants(good).items():
        (ck / "manifest.json").write_text(text)
        for argv in (["checkpoint", "inspect", ck], ["checkpoint", "inspect", "--no-verify", ck],
                     ["checkpoint", "export", ck, "--to", tmp_path / "hf"]):
            rc, errors = run_cli(argv, capsys)
            assert rc == 2 and len(errors) == 1, (name, argv, errors)
            assert f"{ck / 'manifest.json'}: " in errors[0] and fragment in errors[0], (name, argv, errors)
        if name == "step missing":  # a resume reads it the same way (each variant: the slow test below)
            with pytest.raises(Exception, match=re.escape(fragment)) as err:
                _train([f"run.output_dir={tmp_path / 'run'}", f"checkpoint.resume={ck}"], steps=5)
            assert type(err.value).__name__ == "CheckpointError"
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_trainer_state_of_the_wrong_types_is_one_line_naming_the_file_and_key(finished, tmp_path):
    import torch

    good = torch.load(finished / "checkpoints" / "step_4" / "trainer_state_rank0.pt", weights_only=True)
    variants = {
        "a list": ([1, 2], "not a trainer state (a list"),
        "step a string": ({**good, "step": "x"}, "key step must be an integer"),
        "scheduler missing": ({k: v for k, v in good.items() if k != "scheduler"}, "key scheduler is missing"),
        "scheduler.last_epoch a string": ({**good, "scheduler": {**good["scheduler"], "last_epoch": "x"}},
                                          "key scheduler.last_epoch must be a int"),
        "scheduler.base_lrs missing": ({**good, "scheduler": {k: v for k, v in good["scheduler"].items()
                                                              if k != "base_lrs"}}, "key scheduler.base_lrs is missing"),
        "loader a list": ({**good, "loader": []}, "key loader must be a dict, not a list"),
        "loader.step missing": ({**good, "loader": {k: v for k, v in good["loader"].items() if k != "step"}},
                                "loader: key 'step' is missing"),
        "rng.numpy missing": ({**good, "rng": {k: v for k, v in good["rng"].items() if k != "numpy"}},
                              "rng: key 'numpy' is missing"),
        "rng.numpy.kind missing": ({**good, "rng": {**good["rng"], "numpy": {k: v for k, v in good["rng"]["numpy"]
                                                                             .items() if k != "kind"}}},
                                   "rng: key 'kind' is missing"),
    }
    for name, (state, fragment) in variants.items():
        ck = tmp_path / "c" / name.replace(" ", "_") / "step_4"
        shutil.copytree(finished / "checkpoints" / "step_4", ck)
        torch.save(state, ck / "trainer_state_rank0.pt")
        _rehash(ck, "trainer_state_rank0.pt")
        with pytest.raises(Exception, match=re.escape(fragment)) as err:
            _train([f"run.output_dir={tmp_path / 'run'}", f"checkpoint.resume={ck}", "checkpoint.interval=2"], steps=5)
        assert type(err.value).__name__ == "CheckpointError" and "trainer_state_rank0.pt: " in str(err.value), name
        assert not list((tmp_path / "run").glob("checkpoints/step_*")), name


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_full_disk_during_a_save_is_one_line_and_latest_stays(small_disk, tmp_path, async_save, capsys):
    ck = small_disk / "ck"
    with pytest.raises(Exception, match=rf"^no space left on device while saving step 4 to {re.escape(str(ck))}; the "
                                        r"last committed checkpoint is step 2 \(free some space") as err:
        _train([f"run.output_dir={tmp_path / 'run'}", f"checkpoint.dir={ck}", "checkpoint.interval=2",
                f"checkpoint.async_save={str(async_save).lower()}"], steps=4)
    assert type(err.value).__name__ == "CheckpointError"
    assert (ck / "LATEST").read_text() == "step_2\n" and sorted(p.name for p in ck.iterdir()) == ["LATEST", "step_2"]
    capsys.readouterr()
    rc, _errors = run_cli(["checkpoint", "inspect", ck], capsys)
    assert rc == 0
