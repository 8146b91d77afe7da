"""Weighted data mixing (data.mix, data/mix.py): the realised proportions, global batch k the same at any world size
and micro batch size, exact resume (at another world size, with a stream and with background workers), packing
in a mix, per-source validation, and bad input refused in one line. The multi-process resume is
tests/parallel/test_data_resume.py (its `mix` config)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from meshforge.config import load_config
from meshforge.data import batch_loader, build_source
from meshforge.data.mix import BLOCK, MixSchedule
from meshforge.data.workers import background
from meshforge.errors import ConfigError, DataError
from meshforge.testing.parity import base_overrides, single_info

ROOT = Path(__file__).resolve().parents[2]
PC = ROOT / "examples" / "data" / "prompt_completion_tiny.jsonl"
SEQ, VOCAB = 32, 256


def mix(*entries: str) -> str:
    return "data.mix=[" + ", ".join("{" + e + "}" for e in entries) + "]"


SFT = f"name: sft, source: dataset, paths: [{PC}], format: prompt_completion, packing: true"
TEXT = f"name: text, source: dataset, paths: [{PC}], text_field: prompt"
STREAM = f"name: stream, source: dataset, paths: [{PC}], text_field: completion, streaming: true"
SYN = "name: syn, source: synthetic"
MIX = mix(SFT + ", weight: 0.5", TEXT + ", weight: 0.3", SYN + ", weight: 0.2")
MIX_STREAM = mix(STREAM + ", weight: 2", TEXT + ", weight: 1", SYN + ", weight: 1")


def cfg_of(overrides, steps: int = 4):
    # the base run reads data.source=synthetic: back to the default, which data.mix replaces
    return load_config(None, base_overrides(steps) + ["data.source=text", *overrides], world_size=1)


def loader_of(cfg, dp_rank=0, dp_size=1, micro=2, workers=0):
    source = build_source(cfg.data, SEQ, VOCAB, cfg.run.seed)
    loader = batch_loader(source, 8, micro, dp_rank, dp_size, cfg.run.seed)
    return background(loader, cfg.data.model_copy(update={"num_workers": workers})) if workers else loader


def global_batch(loaders) -> list[torch.Tensor]:
    """Global batch from every dp rank's loader (next batch of each), stacked per tensor (inputs, labels, ...)."""
    parts = [torch.cat(list(t)) for t in zip(*[mb for ld in loaders for mb in ld.next_batch()])]
    return parts


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 2, 7], [1, 1, 1], [0.9, 0.05, 0.05], [3, 1]])
def test_proportions_within_one_percent_over_1000_samples(weights):
    sched = MixSchedule(weights, [f"s{i}" for i in range(len(weights))])
    share = np.asarray(weights) / sum(weights)
    for start in (0, 137, BLOCK - 500, 7 * BLOCK + 4321):  # any 1,000 consecutive samples, across block edges
        got = np.bincount([sched.at(p)[0] for p in range(start, start + 1000)], minlength=len(weights)) / 1000
        assert np.abs(got - share).max() < 0.01, (start, got, share)
        assert np.array_equal(sched.counts(start + 1000) - sched.counts(start), np.round(got * 1000))
    # each source's samples are taken in order, none skipped or repeated: n runs 0, 1, 2, ... per source
    seen = [[] for _ in weights]
    for p in range(3 * BLOCK):
        s, n = sched.at(p)
        seen[s].append(n)
    assert all(v == list(range(len(v))) for v in seen)


def test_the_loader_trains_on_the_realised_proportions():
    cfg = cfg_of([MIX])
    ld = loader_of(cfg)
    picks = [s for k in range(125) for s, _ in ld.global_batch(k)]  # 1,000 samples
    got = np.bincount(picks, minlength=3) / len(picks)
    assert np.abs(got - [0.5, 0.3, 0.2]).max() < 0.01, got
    assert ld.realised(125) == pytest.approx(dict(zip(["sft", "text", "syn"], got)), abs=1e-12)


@pytest.mark.parametrize("overrides", [MIX, MIX_STREAM], ids=["random_access", "with_stream"])
def test_global_batch_is_the_same_at_any_world_size_and_micro_batch(overrides):
    cfg = cfg_of([overrides])
    ref_loader = loader_of(cfg, micro=8)
    ref = [global_batch([ref_loader]) for _ in range(6)]
    for dp, micro in ((2, 2), (4, 1), (2, 4)):
        loaders = [loader_of(cfg, r, dp, micro) for r in range(dp)]
        for k in range(6):
            got = global_batch(loaders)
            assert len(got) == len(ref[k]) and all(torch.equal(a, b) for a, b in zip(got, ref[k])), (dp, micro, k)


@pytest.mark.parametrize("overrides,workers", [(MIX, 2), (MIX_STREAM, 1)], ids=["random_access", "with_stream"])
def test_resume_mid_epoch_at_another_world_size_is_exact(overrides, workers):
    cfg = cfg_of([overrides])
    ref_loader = loader_of(cfg, micro=8)
    ref = [global_batch([ref_loader]) for _ in range(40)]  # past the end of every finite source: new epochs
    # 2 ranks with background workers for 17 batches, then a resume on 1 rank (no workers) and on 4
    first = [loader_of(cfg, r, 2, 2, workers=workers) for r in range(2)]
    for k in range(17):
        assert all(torch.equal(a, b) for a, b in zip(global_batch(first), ref[k]))
    state = json.loads(json.dumps(first[0].state_dict()))  # as a checkpoint holds it
    for ld in first:
        ld.close()
    for dp in (1, 4):
        again = [loader_of(cfg, r, dp, 8 // dp // 2 or 1) for r in range(dp)]
        for ld in again:
            ld.load_state_dict(state)
        for k in range(17, 40):
            assert all(torch.equal(a, b) for a, b in zip(global_batch(again), ref[k])), (dp, k)


def test_a_resume_with_other_weights_is_refused():
    cfg = cfg_of([MIX])
    state = loader_of(cfg).state_dict()
    other = loader_of(cfg_of([MIX.replace("weight: 0.5", "weight: 0.6")]))
    with pytest.raises(ValueError, match="data settings changed|data mix"):
        other.load_state_dict(state)


def test_packing_in_a_mix_keeps_each_sources_samples():
    """A packed SFT source's rows keep their labels and document ids; a text source's rows get one document."""
    cfg = cfg_of([MIX])
    src = build_source(cfg.data, SEQ, VOCAB, cfg.run.seed)
    ld = batch_loader(src, 8, 8, 0, 1, cfg.run.seed)
    for k in range(3):
        x, y, docs = ld.batch(k)[0]
        for row, (s, i) in enumerate(ld.global_batch(k)):
            one = src.sources[s]
            if s == 0:  # packed SFT: (inputs, labels, document ids) exactly as the source alone builds them
                ex, ey, ed = one.batch([i])
                assert np.array_equal(x[row], ex[0]) and np.array_equal(y[row], ey[0]) and np.array_equal(
                    docs[row], ed[0])
            else:
                seq = one.samples([i])[0]
                assert np.array_equal(x[row], seq[:-1]) and np.array_equal(y[row], seq[1:])
                assert not docs[row].any()
    assert any(s == 0 for s, _ in ld.global_batch(0)) and (y == -100).any()


def test_training_logs_proportions_and_a_validation_loss_per_source(tmp_path):
    from meshforge.training.trainer import train

    val = ", validation: {fraction: 0.2, batches: 1}"
    overrides = [mix(SFT + ", weight: 3" + val, TEXT + ", weight: 1" + val), "training.val_every=2",
                 "logging.loggers=[jsonl]", f"run.output_dir={tmp_path}"]
    res = train(cfg_of(overrides, steps=4), single_info())
    assert len(res.losses) == 4 and all(np.isfinite(res.losses))
    v = res.validations[-1]
    assert {"val_loss/sft", "val_loss/text", "val_ppl/sft", "val_ppl/text"} <= set(v)
    assert v["val_loss/sft"] != v["val_loss/text"]
    assert v["val_loss"] == pytest.approx((3 * v["val_loss/sft"] + v["val_loss/text"]) / 4)
    recs = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step4 = [r for r in recs if r.get("step") == 4 and "loss" in r][0]
    assert step4["mix/sft"] + step4["mix/text"] == pytest.approx(1)
    assert step4["mix/sft"] == pytest.approx(24 / 32)  # the schedule's exact count over 4 x 8 samples


@pytest.mark.parametrize("entry,message", [
    ("weight: 0", "data.mix.0.weight: must be a positive number"),
    ("weight: -1", "data.mix.0.weight: must be a positive number"),
    ("weight: abc", "data.mix.0.weight: must be a positive number"),
    ("weight: .nan", "data.mix.0.weight: must be a positive number"),
    ("weight: true", "data.mix.0.weight: must be a positive number"),
    ("source: synthetic", "data.mix.0.weight: Field required"),
])
def test_bad_weights_are_one_line(entry, message):
    with pytest.raises(ConfigError) as err:
        cfg_of([mix(entry, SYN + ", weight: 1")])
    assert any(message in p for p in err.value.problems), err.value.problems


def test_mix_keys_are_refused_next_to_a_source_and_names_must_differ():
    with pytest.raises(ConfigError, match="data.paths is set next to data.mix"):
        cfg_of([MIX, "data.paths=[a.txt]"])
    with pytest.raises(ConfigError, match="names must differ"):
        cfg_of([mix(SYN + ", weight: 1", SYN + ", weight: 2")])
    with pytest.raises(ConfigError, match="data.mix is empty"):
        cfg_of(["data.mix=[]"])


def test_a_source_that_yields_nothing_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = cfg_of([mix(SYN + ", weight: 1", f"name: bare, source: dataset, paths: [{empty}], weight: 1")])
    with pytest.raises(DataError, match=r"data.mix\[1\] \(bare\): "):
        build_source(cfg.data, SEQ, VOCAB, 0)
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "ab"}\n')
    cfg = cfg_of([mix(SYN + ", weight: 1", f"name: short, source: dataset, paths: [{tiny}], streaming: true, "
                                           "weight: 1")])
    ld = batch_loader(build_source(cfg.data, SEQ, VOCAB, 0), 8, 2, 0, 1, 0)
    with pytest.raises(DataError, match="fewer tokens than one sequence"):
        ld.next_batch()
