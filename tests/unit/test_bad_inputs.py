"""Bad input gets one line and exit 2, never a traceback: the corpus under tests/corpus/bad_inputs (configs, data
files, damaged and malicious checkpoints; `cases.yaml` lists each command, its exit code and a fragment of its
message), and random YAML documents and overrides fed to `validate` (hypothesis)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshforge.cli import main

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "corpus" / "bad_inputs"
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text())


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as err:  # argparse's own usage errors
        rc = err.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", CASES, ids=[c["argv"].split("{corpus}/")[-1][:60] for c in CASES])
def test_bad_input_is_one_line(case, tmp_path, capsys, monkeypatch):
    if case.get("skip_if") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("MESHFORGE_PWNED", str(pwned))  # what the malicious checkpoints' payloads would create
    argv = [a.format(corpus=CORPUS, tmp=tmp_path, examples=ROOT / "examples") for a in shlex.split(case["argv"])]
    rc, _out, err = run_cli(argv, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == case["code"], err[-3000:]
    assert "Traceback" not in err and errors, err[-3000:]
    assert any(case["message"] in ln for ln in errors), err[-3000:]
    assert all(len(ln) < 1000 for ln in err.splitlines()), "an error line quotes a huge value"
    assert not pwned.exists(), "a checkpoint ran code"


@pytest.mark.parametrize("argv, says", [
    ("bogus", "meshforge: argument command: invalid choice: 'bogus'"),
    ("train", "meshforge train: the following arguments are required: config ("),
    ("train {examples}/tiny_cpu.yaml --zzz", "meshforge train: unrecognized arguments: --zzz"),
    ("plan {examples}/llama3_8b.yaml --world-size 1e3", "meshforge plan: argument --world-size: invalid int"),
    ("data prepare -o x.npy --qq", "meshforge data prepare: unrecognized arguments: --qq"),
    ("checkpoint export", "meshforge checkpoint export: the following arguments are required"),
])
def test_a_bad_command_line_is_one_line_naming_the_subcommand(argv, says, capsys):
    """argparse prints its whole usage before the error; meshforge's parsers print the one line."""
    rc, out, err = run_cli(shlex.split(argv.format(examples=ROOT / "examples")), capsys)
    assert rc == 2 and not out and err.count("\n") == 1 and err.startswith(f"error: {says}"), err
    assert "--help` lists the arguments" in err


def test_corpus_is_all_used():
    named = " ".join(c["argv"] for c in CASES)
    for f in CORPUS.iterdir():
        if f.name != "cases.yaml":
            assert f"{{corpus}}/{f.name}" in named, f"{f.name} is in the corpus but no case uses it"


# ------------------------------------------------------------------------- random input
KEYS = ["run.seed", "run.name", "training.max_steps", "training.seq_len", "training.global_batch_size",
        "training.micro_batch_size", "training.device", "training.precision", "distributed.strategy",
        "distributed.tp_size", "distributed.dp_size", "checkpoint.resume", "checkpoint.save", "checkpoint.interval",
        "dist.use_megatron_fsdp", "ddp.use_megatron_fsdp", "model.preset", "model.n_layers", "optimizer.lr",
        "logging.log_every", "data.source", "nosuch.key", "training", "run"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True), st.text(max_size=12),
                    st.sampled_from(["fsdp2", "ddp", "megatron_fsdp", "tiny", "cpu", "none", "auto", "1e-3"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.sampled_from(KEYS + ["x"]), inner,
                                                                        max_size=3)), max_leaves=6)
sections = st.dictionaries(st.sampled_from(["run", "model", "data", "distributed", "training", "checkpoint",
                                            "logging", "dist", "ddp", "optimizer", "bogus"]),
                           st.one_of(st.dictionaries(st.sampled_from([k.split(".")[-1] for k in KEYS]), values,
                                                     max_size=4), scalars), max_size=4)
documents = st.one_of(sections, values, st.text(max_size=40))  # a mapping, any YAML value, or any text
overrides = st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS),
                                         st.one_of(st.text(max_size=10), scalars.map(str))),
                               st.text(max_size=15)), max_size=3)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents, edits=overrides, world=st.sampled_from([None, 1, 2, 8]))
def test_validate_random_input_is_0_or_2(doc, edits, world, tmp_path, capsys):
    f = tmp_path / "random.yaml"
    f.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    argv = ["validate", str(f), *[e for e in edits if not e.startswith("-")]]
    if world is not None:
        argv += ["--world-size", str(world)]
    rc, _out, err = run_cli(argv, capsys)
    assert rc in (0, 2), err[-3000:]
    assert "Traceback" not in err
    if rc == 2:
        assert err.strip(), "exit 2 without a line saying why"
