"""Single-process training end to end: loss falls, metrics.jsonl, CLI exit codes."""

import json
import math

import pytest

from meshforge.cli import main
from meshforge.config import load_config
from meshforge.training.optim import lr_factor
from meshforge.training.trainer import train


@pytest.mark.slow  # 60 steps on text: seconds (the documented commands run tiny_cpu in the fast tier)
def test_short_run_on_stdlib_text_loss_falls(tmp_path):
    out = tmp_path / "run"
    rc = main(["train", "examples/tiny_cpu.yaml", "training.max_steps=60", "logging.log_every=10",
               "logging.progress=plain", f"run.output_dir={out}", "data.max_files=10"])
    assert rc == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [10, 20, 30, 40, 50, 60]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "max_mem_gib"):
        assert key in recs[0]
    assert recs[0]["mfu"] is None  # CPU: no peak known, so no invented MFU
    assert recs[0]["tokens_per_s"] > 0 and recs[0]["tflops"] > 0 and recs[0]["max_mem_gib"] > 0
    assert recs[-1]["loss"] < 0.75 * recs[0]["loss"] < 0.75 * math.log(256) * 1.2
    assert (out / "config.yaml").exists()


def test_accumulation_gives_the_same_training():
    base = ["data.source=synthetic", "training.max_steps=4", "training.seq_len=16", "logging.progress=none",
            "logging.jsonl=false", "training.global_batch_size=4", "checkpoint.resume=none"]
    a = train(load_config(None, base + ["training.micro_batch_size=4"]))
    b = train(load_config(None, base + ["training.micro_batch_size=1"]))
    assert max(abs(x - y) / x for x, y in zip(a.losses, b.losses)) < 1e-5


def test_schedules():
    from meshforge.config.schema import SchedulerConfig

    cos = SchedulerConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cos, 110) == 0.1 and lr_factor(9, cos, 110) == 1.0
    assert abs(lr_factor(110, cos, 110) - 0.1) < 1e-9 and abs(lr_factor(60, cos, 110) - 0.55) < 1e-9
    lin = SchedulerConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(50, lin, 100) == 0.5
    assert lr_factor(99, SchedulerConfig(name="constant"), 100) == 1.0


def test_bad_inputs_exit_2_without_traceback(tmp_path, capsys):
    assert main(["train", "examples/tiny_cpu.yaml", "data.source=tokenized", f"data.path={tmp_path}/none.npy",
                 "data.max_files=null",
                 f"run.output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    assert main(["train", "examples/tiny_cpu.yaml", "distributed.tp_size=3"]) == 2
    assert "does not divide the world size 1" in capsys.readouterr().err
