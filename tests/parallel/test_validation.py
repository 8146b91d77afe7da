"""Validation (data.validation + training.val_every): the same val_loss at any world size and parallelism, and
exact resume with validation on (it touches neither the training loader nor the RNG).

The data are the prompt/completion examples (uneven label masks), 10% held out by the fixed split; 3 steps,
validation at each. Tolerance: relative 1e-5 against the single process (reduction order differs).
"""

from pathlib import Path

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import config, single_info

pytestmark = pytest.mark.dist

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "prompt_completion_tiny.jsonl"
VAL = ["data.source=dataset", f"data.paths=[{DATA}]", "data.format=prompt_completion", "training.seq_len=32",
       "data.validation.fraction=0.15", "data.validation.batches=2", "training.val_every=1"]
STEPS, RTOL = 2, 1e-5
PP = ["model.n_layers=4", "distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=2"]
N2 = {"fsdp2 accum": ["training.micro_batch_size=1"],
      "megatron_fsdp": ["distributed.strategy=megatron_fsdp"], "cp2": ["distributed.cp_size=2"],
      "tp2+sp": ["distributed.tp_size=2", "distributed.sequence_parallel=true"], "pp2": PP}


def val_job(spec, info) -> dict:
    from meshforge.training.trainer import train

    out = {}
    for name, overrides in spec.items():
        try:
            res = train(config(VAL + overrides, STEPS, info.world_size), info)
            out[name] = {"val": [v["val_loss"] for v in res.validations], "losses": res.losses}
        except Exception as err:  # reported to the test
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


GROUP_JOBS = [Job("validation n2", f"{Path(__file__).resolve()}:val_job", N2, 2)]


def _single(extra=(), steps=STEPS, **kw):
    from meshforge.training.trainer import train

    return train(config(VAL + list(extra), steps, world_size=1), single_info())


@pytest.fixture(scope="module")
def single():
    return {n: _single(["model.n_layers=4"] if n == "pp2" else []) for n in ("dense", "pp2")}


def test_validation_is_the_same_at_any_parallelism(group, single):
    results = group("validation n2")
    bad = []
    for name, got in results.items():
        ref = single["pp2" if name == "pp2" else "dense"]
        want = [v["val_loss"] for v in ref.validations]
        if "error" in got:
            bad.append(f"{name}: {got['error'][:800]}")
            continue
        rel = max(abs(a - b) / abs(a) for a, b in zip(want, got["val"]))
        print(f"validation {name}: max rel diff {rel:.2e}")
        if len(got["val"]) != STEPS or rel > RTOL:
            bad.append(f"{name}: val_loss {got['val']} vs single process {want}")
    assert not bad, "\n".join(bad)


def test_validation_reaches_metrics(tmp_path):
    import json

    res = _single([f"run.output_dir={tmp_path}", "logging.jsonl=true"], steps=2)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in vals] == [1, 2] and vals[-1]["val_loss"] == res.validations[-1]["val_loss"]
    assert abs(vals[0]["val_ppl"] - 2.718281828 ** vals[0]["val_loss"]) < 1e-3 * vals[0]["val_ppl"]


def test_resume_is_exact_with_validation_on(single, tmp_path):
    ref = single["dense"]
    ckpt = [f"run.output_dir={tmp_path / 'a'}", "checkpoint.interval=1", "checkpoint.resume=none"]
    first = _single(ckpt)
    assert first.losses == ref.losses  # checkpointing itself changes nothing
    step1 = tmp_path / "a" / "checkpoints" / "step_1"
    resumed = _single([f"run.output_dir={tmp_path / 'b'}", f"checkpoint.resume={step1}"])
    assert resumed.start_step == 1
    assert resumed.losses == ref.losses[1:]  # bitwise
    assert [v["val_loss"] for v in resumed.validations] == [v["val_loss"] for v in ref.validations[1:]]


def test_validation_from_files_and_held_out_split_is_disjoint(tmp_path):
    from meshforge.data import build_source
    from meshforge.data.sources import split_validation

    cfg = config(VAL, 1, world_size=1)
    train_src, val_src = split_validation(cfg.data, build_source(cfg.data, 32, 256, 7), 32, 256, 7)
    assert set(train_src.indices.tolist()).isdisjoint(val_src.indices.tolist())
    assert train_src.num_samples + val_src.num_samples == 64 and val_src.num_samples == 10
    files = config([v for v in VAL if "fraction" not in v] + [f"data.validation.paths=[{DATA}]"], 1, world_size=1)
    t2, v2 = split_validation(files.data, build_source(files.data, 32, 256, 7), 32, 256, 7)
    assert v2.num_samples == t2.num_samples == 64 and v2.digest() == build_source(files.data, 32, 256, 7).digest()
    assert {f"validation {k}": v for k, v in v2.inputs.items()}.items() <= t2.inputs.items()  # resume checks them


def test_validation_keys_go_together():
    from meshforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="training.val_every=2 needs data.validation"):
        load_config(None, ["training.val_every=2"], world_size=1)
    with pytest.raises(ConfigError, match="would never run"):
        load_config(None, VAL[:4] + ["data.validation.fraction=0.1"], world_size=1)
    with pytest.raises(ConfigError, match="exactly one of paths"):
        load_config(None, VAL + ["data.validation.paths=[x.jsonl]"], world_size=1)
