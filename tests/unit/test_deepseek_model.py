"""DeepSeek-V3's model contract, in one process: FLOPs per token from the closed form equal a counted forward
(`torch.utils.flop_counter.FlopCounterMode`), the planner's torch-free view (two block shapes) and TP plan checks,
the family's own validation, and the planner's state for the published shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from meshforge.models import PRESETS, build_model, init_weights
from meshforge.planning.estimate import model_params
from meshforge.planning.tp_plan import config_plan_problems
from meshforge.testing.parity import config


@pytest.mark.parametrize("over", [{}, {"q_lora_rank": 0, "first_k_dense": 0, "n_shared_experts": 2},
                                  {"first_k_dense": 2}])
def test_flops_per_token_closed_form_equals_a_counted_forward(over):
    args = dataclasses.replace(PRESETS["tiny_deepseek"], **over)
    model = build_model(args).eval()
    init_weights(model, 0)
    for layer in model.moe_layers():
        layer.experts.use_grouped_mm = False  # the counter counts matmuls (the loop), not torch._grouped_mm
    seq = 64
    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    counts = counter.get_flop_counts()["Global"]
    # the attention's two batched matmuls (SDPA's math path on CPU: bmm; a fused kernel: its own op); every other
    # matmul is a projection or an expert (2-D mm)
    attention = sum(v for op, v in counts.items() if "attention" in str(op) or "bmm" in str(op))
    matmul = counter.get_total_flops() - attention
    assert attention > 0 and matmul > 0
    # training = 3 x forward; the closed form counts the attention scores under the causal mask (half of them)
    counted = 3 * (matmul + attention / 2) / tokens.numel()
    print(f"\n{over}: closed form {model.flops_per_token(seq):.0f}, counted forward x 3 {counted:.0f} FLOPs/token")
    assert model.flops_per_token(seq) == counted


def test_planner_sees_both_block_shapes_and_checks_the_tp_plan():
    cfg = config(["model.preset=tiny_deepseek", "model.n_layers=4", "model.first_k_dense=1"])
    params, _ = model_params(cfg)
    real = build_model(cfg.model, device="meta")
    assert [(p.name, p.shape) for p in params] != []
    assert {p.name: p.shape for p in params} == {n: tuple(p.shape) for n, p in real.named_parameters()}
    assert sum(p.expert for p in params) == 3 * 3  # w1, w2, w3 of the 3 MoE layers
    assert config_plan_problems(cfg.model, 2, False, None) == []
    problems = config_plan_problems(cfg.model, 3, False, None)
    assert any("'layers.*.attention.wkv_b' with weight shape [128, 32] cannot be split colwise" in p
               for p in problems), problems


@pytest.mark.parametrize(("over", "expected"), [
    (["model.n_group=3"], "not divisible by model.n_group=3"),
    (["model.topk_group=8"], "model.topk_group=8 exceeds model.n_group=4"),
    (["model.top_k=6", "model.topk_group=2"], "model.top_k=6 exceeds the experts of model.topk_group=2 groups"),
    (["model.rope_type=llama3"], "must be default or yarn for model.family=deepseek_v3"),
    (["model.preset=tiny", "model.rope_type=yarn"], "must be default or llama3 for model.family=llama"),
    (["model.preset=tiny", "model.kv_lora_rank=8"], "model.kv_lora_rank is read only by model.family=deepseek_v3"),
    (["model.n_kv_heads=2"], "model.n_kv_heads=2 must equal model.n_heads=4"),
    (["model.head_dim=16"], "model.head_dim=16 must be qk_nope_head_dim \\+ qk_rope_head_dim = 24"),
    (["model.score_func=softmax"], "model.score_func=softmax is not read by model.family=deepseek_v3"),
    (["model.qk_norm=true"], "model.qk_norm=True is not read"),
])
def test_family_validation_one_line(over, expected):
    from meshforge.errors import ConfigError

    with pytest.raises(ConfigError, match=expected):
        config(["model.preset=tiny_deepseek", *over])


def test_published_shape_plans_without_torch_state():
    """The 671B preset: the planner's parameter count equals transformers' (tests/checkpoint/test_hf_families.py
    checks it against transformers), 61 blocks of two shapes, 58 x 3 stacked expert tensors."""
    cfg = config(["model.preset=deepseek_v3", "training.seq_len=4096"], world_size=1)
    params, args = model_params(cfg)
    assert sum(torch.Size(p.shape).numel() for p in params) == 671_026_404_352
    assert len({p.block for p in params if p.block is not None}) == 61
    assert sum(p.expert for p in params) == 58 * 3
