"""The tensor-parallel plan, without processes: pattern matching, config plans laid over the model's declared
plan, and every mistake reported before training with the module name and shape (one line, exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from meshforge.config import ConfigError, load_config
from meshforge.config.schema import ModelConfig
from meshforge.planning.tp_plan import (
    config_plan_problems,
    pattern_matches,
    plan_problems,
    resolve_plan,
)
from meshforge.models import build_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tiny():
    return build_model(ModelConfig(preset="tiny"), device="meta")


def test_patterns_match_one_component_per_star():
    assert pattern_matches("layers.*.attention.wq", "layers.12.attention.wq")
    assert not pattern_matches("layers.*", "layers.0.attention.wq")
    assert pattern_matches("layers.*.feed_forward.w[13]", "layers.0.feed_forward.w3")
    assert not pattern_matches("layers.*.feed_forward.w[13]", "layers.0.feed_forward.w2")


def test_declared_plan_resolves_every_projection():
    resolved, declared, problems = resolve_plan(tiny(), sequence_parallel=False, custom=None)
    assert not problems and resolved == declared
    assert resolved["tok_embeddings"] == "vocab_embedding" and resolved["output"] == "vocab_output"
    assert resolved["layers.1.attention.wk"] == "colwise" and resolved["layers.1.feed_forward.w2"] == "rowwise"
    assert len(resolved) == 2 + 2 * 7
    sp, _, _ = resolve_plan(tiny(), sequence_parallel=True, custom=None)
    assert sp["layers.0.ffn_norm"] == "sequence_parallel" and sp["norm"] == "sequence_parallel"
    assert sp["layers.0.attention"] == "sequence_gather" and len(sp) == len(resolved) + 1 + 2 * 4


def test_config_plan_overrides_module_by_module():
    custom = {"output": "colwise", "layers.0.feed_forward.*": "replicate", "tok_embeddings": "replicate"}
    resolved, _, problems = resolve_plan(tiny(), False, custom)
    assert not problems
    assert resolved["output"] == "vocab_output"  # colwise on the logits keeps the vocabulary-parallel loss
    assert resolved["tok_embeddings"] == "replicate"
    assert resolved["layers.0.feed_forward.w1"] == "replicate" and resolved["layers.1.feed_forward.w1"] == "colwise"


def test_bad_plans_name_module_and_shape():
    model = tiny()
    msgs = plan_problems(model, 3, False, None)  # 3 divides nothing of the tiny model
    assert any("'tok_embeddings' with weight shape [256, 64]" in m and "tp_size=3" in m for m in msgs)
    assert any("'layers.*.feed_forward.w1' with weight shape [176, 64]" in m and "(in 2 layers)" in m for m in msgs)
    msgs = plan_problems(model, 2, False, {"layers.*.attention.q_proj": "colwise"})
    assert msgs == [("distributed.tp_plan pattern 'layers.*.attention.q_proj' names no module of the model: "
                     "patterns match dotted module names per component, e.g. 'layers.*.attention.wq'")]
    msgs = plan_problems(model, 2, False, {"layers.0.attention_norm": "colwise"})
    assert len(msgs) == 1 and "'layers.0.attention_norm' (RMSNorm)" in msgs[0]
    msgs = plan_problems(model, 2, True, {"norm": "replicate"})
    assert len(msgs) == 1 and "'norm' must stay sequence_parallel" in msgs[0]


def test_tied_weights_need_matching_styles():
    tied = build_model(ModelConfig(preset="tiny", tie_embeddings=True), device="meta")
    assert plan_problems(tied, 2, False, None) == []  # vocab embedding and vocab output both split the vocab
    msgs = plan_problems(tied, 2, False, {"output": "replicate"})
    assert len(msgs) == 1 and "tied weight 'tok_embeddings.weight'" in msgs[0] and "'output' whole" in msgs[0]


def test_own_model_needs_a_plan():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 6)

    assert "declares no tp_plan" in plan_problems(Net(), 2, False, None)[0]
    assert plan_problems(Net(), 2, False, {"up": "colwise"}) == []
    msgs = plan_problems(Net(), 4, False, {"up": "colwise", "down": "rowwise"})
    assert msgs == []
    msgs = plan_problems(Net(), 4, False, {"down": "colwise"})
    assert msgs and "'down' with weight shape [6, 32]" in msgs[0] and "dimension 0 = 6" in msgs[0]


def test_large_model_plan_checked_without_memory():
    # one block on the meta device stands in for all 80 layers; specific layer names still resolve
    assert config_plan_problems(ModelConfig(preset="llama3_70b"), 8, True, {"layers.79.attention.wq": "colwise"}) == []
    msgs = config_plan_problems(ModelConfig(preset="llama3_70b"), 8, True, {"layers.80.attention.wq": "colwise"})
    assert len(msgs) == 1 and "'layers.80.attention.wq' names no module" in msgs[0]


BASE = ["training.global_batch_size=8", "training.micro_batch_size=2"]


def test_rules_reject_before_training():
    with pytest.raises(ConfigError) as err:
        load_config(None, BASE + ["distributed.tp_size=2", "model.ffn_dim=175", "data.source=synthetic"],
                    world_size=2)
    assert any("'layers.*.feed_forward.w1' with weight shape [175, 64]" in p for p in err.value.problems)
    with pytest.raises(ConfigError, match="tp_plan is set but distributed.tp_size=1"):
        load_config(None, BASE + ['distributed.tp_plan={"output": "replicate"}'], world_size=2)
    with pytest.raises(ConfigError, match="n_kv_heads=2 is not divisible by distributed.tp_size=4"):
        load_config(None, BASE + ["distributed.tp_size=4"], world_size=4)
    load_config(None, BASE + ["distributed.tp_size=2", "distributed.sequence_parallel=true",
                              'distributed.tp_plan={"output": "replicate"}'], world_size=2)


def test_validate_cli(capsys):
    from meshforge.cli import main

    rc = main(["validate", str(EXAMPLES / "tiny_cpu.yaml"), "distributed.tp_size=2",
               'distributed.tp_plan={"layers.*.feed_forward": "colwise"}', "--world-size", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "'layers.*.feed_forward' (FeedForward)" in err
    # TP groups must stay inside a node
    rc = main(["validate", str(EXAMPLES / "llama3_8b_tp.yaml"), "--world-size", "16", "--gpus-per-node", "4"])
    err = capsys.readouterr().err
    assert rc == 0 and "TP groups span 2 nodes (distributed.tp_size=8, --gpus-per-node=4)" in err
    rc = main(["validate", str(EXAMPLES / "llama3_8b_tp.yaml"), "--world-size", "16", "--gpus-per-node", "8"])
    assert rc == 0 and "gpus-per-node" not in capsys.readouterr().err


def test_examples_validate():
    cfg = load_config(str(EXAMPLES / "llama3_8b_tp.yaml"), [], world_size=64)
    d = cfg.distributed
    assert (d.strategy, d.tp_size, d.sequence_parallel) == ("fsdp2", 8, True)
    cfg = load_config(str(EXAMPLES / "long_context_cp.yaml"), [], world_size=16)
    assert cfg.distributed.cp_size > 1 and cfg.training.seq_len % (2 * cfg.distributed.cp_size) == 0
