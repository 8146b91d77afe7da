"""models/shapes.py describes the built-in models without torch, for `meshforge plan`: it must equal the model
itself (names, shapes, tied weights, module classes) and give the same plan as the meta-device model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import meshforge.models as models
import meshforge.planning.estimate as estimate
import meshforge.planning.tp_plan as tp_plan
from meshforge.cli import main
from meshforge.models import PRESETS, build_model, meta_modules, plan_modules, resolve_model_args
from meshforge.models.hf_families import FAMILIES
from meshforge.testing.parity import config

ROOT = Path(__file__).resolve().parents[2]
TINY_VARIANTS = [{}, {"tie_embeddings": True}, {"qkv_bias": True}, {"attention_bias": True},
                 {"qk_norm": True, "tie_embeddings": True}]
MOE_VARIANTS = [{}, {"n_shared_experts": 0}, {"qk_norm": True, "tie_embeddings": True},
                {"router_bias_update_rate": 1e-3}]
# DeepSeek-V3: q without compression, MoE only, dense only, biases + tied head + no shared experts
DEEPSEEK_VARIANTS = [{"q_lora_rank": 0}, {"first_k_dense": 0}, {"first_k_dense": 2},
                     {"attention_bias": True, "tie_embeddings": True, "n_shared_experts": 0}]
LAYERED_VARIANTS = [("tiny_gpt_oss", {"attention_bias": False, "tie_embeddings": True, "sliding_window": None,
                                      "sliding_window_pattern": None, "router_bias_update_rate": 1e-3}),
                    ("tiny_gemma3", {"attention_bias": True, "tie_embeddings": False, "final_logit_softcap": None})]
CASES = ([(name, {}) for name in PRESETS] + [("tiny", v) for v in TINY_VARIANTS[1:]]
         + [("tiny_moe", v) for v in MOE_VARIANTS[1:]] + [("tiny_deepseek", v) for v in DEEPSEEK_VARIANTS]
         + LAYERED_VARIANTS)


def describe(args):
    """The description the family declares (models/hf_families.py)."""
    return FAMILIES[args.family].describe(args)


def _params(model) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, index of the tensor) of every parameter, tied ones under each name, in module order."""
    ids: dict[int, int] = {}
    return [(n, tuple(p.shape), ids.setdefault(id(p), len(ids)))
            for n, p in model.named_parameters(remove_duplicate=False)]


@pytest.mark.parametrize("preset,over", CASES, ids=[f"{p}-{'-'.join(o) or 'preset'}" for p, o in CASES])
def test_description_equals_the_meta_model(preset, over):
    # two blocks: every block is built alike, so this proves the container and the block for any depth
    args = dataclasses.replace(PRESETS[preset], n_layers=2, **over)
    model, shape = build_model(args, device="meta"), describe(args)
    assert _params(shape) == _params(model)
    assert [(n, m.kind) for n, m in shape.named_modules()] == [(n, type(m).__name__) for n, m in model.named_modules()]
    assert all(p.requires_grad for p in shape.parameters())
    for sp in (False, True):
        assert shape.tp_plan(sp) == model.tp_plan(sp)
    assert shape.pipeline_layout() == model.pipeline_layout()
    assert shape.flops_per_token(512) == model.flops_per_token(512)
    assert [[n for n, _ in m.named_parameters()] for m in shape.moe_layers()] == \
        [[n for n, _ in m.named_parameters()] for m in model.moe_layers()]


LORA = [("tiny", {}, ["*_proj"], ("embeddings", "norms"), 0.0),
        ("tiny", {"qk_norm": True, "tie_embeddings": True}, ["q_proj", "v_proj"], ("embeddings",), 0.1),
        ("tiny", {"qkv_bias": True, "attention_bias": True}, ["o_proj", "down_proj"], ("norms",), 0.0),
        ("tiny_moe", {}, ["*"], ("embeddings", "norms"), 0.0),
        ("tiny_moe", {"tie_embeddings": True}, ["experts.down_proj", "k_proj"], (), 0.0),
        ("tiny_moe", {"n_shared_experts": 0, "qk_norm": True}, ["experts.gate_up_proj"], ("norms",), 0.0),
        ("tiny_deepseek", {}, ["*"], ("embeddings", "norms"), 0.0),
        ("tiny_deepseek", {"q_lora_rank": 0, "first_k_dense": 2}, ["q_proj", "kv_*", "down_proj"], ("norms",), 0.1),
        ("tiny_gpt_oss", {}, ["*"], ("embeddings", "norms"), 0.0),
        ("tiny_gpt_oss", {}, ["experts.down_proj", "q_proj"], ("embeddings",), 0.0),
        ("tiny_gemma3", {}, ["*_proj"], ("embeddings",), 0.0)]


@pytest.mark.parametrize("preset,over,targets,freeze,dropout", LORA)
def test_lora_description_equals_the_adapted_meta_model(preset, over, targets, freeze, dropout):
    from types import SimpleNamespace

    from meshforge.models.lora import apply_lora
    from meshforge.models.shapes import apply_lora as apply_to_description

    args = dataclasses.replace(PRESETS[preset], n_layers=2, **over)
    pcfg = SimpleNamespace(rank=4, alpha=8.0, dropout=dropout, target_modules=targets, freeze=freeze)
    model, shape = build_model(args, device="meta"), describe(args)
    assert apply_to_description(shape, pcfg) == apply_lora(model, pcfg)
    assert _params(shape) == _params(model)
    assert [p.requires_grad for _, p in shape.named_parameters(remove_duplicate=False)] == \
        [p.requires_grad for _, p in model.named_parameters(remove_duplicate=False)]
    assert [(n, m.kind) for n, m in shape.named_modules()] == [(n, type(m).__name__) for n, m in model.named_modules()]


def _plan_json(capsys, argv: list[str]) -> dict:
    for cache in (tp_plan._PLAN_PROBLEMS, estimate._STAGE_CACHE):
        cache.clear()
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


PLANS = [
    ["llama3_70b_tp_pp.yaml", "--world-size", "64"],
    ["qwen3_moe_ep8.yaml", "--world-size", "64"],
    ["tiny_cpu.yaml", "--world-size", "4", "distributed.tp_size=2", "model.qkv_bias=true", "model.qk_norm=true"],
    ["tiny_cpu.yaml", "--world-size", "4", "distributed.tp_size=2", "model.tie_embeddings=true",
     "distributed.strategy=megatron_fsdp"],
    ["moe_ep_cpu.yaml", "--world-size", "4", "distributed.tp_size=2", "model.tie_embeddings=true"],
    ["lora_tiny_cpu.yaml", "--world-size", "2", "distributed.tp_size=2", "distributed.sequence_parallel=true",
     "peft.target_modules=[q_proj,v_proj,down_proj]", "peft.freeze=[embeddings]", "model.tie_embeddings=true"],
    ["moe_ep_cpu.yaml", "--world-size", "4", "distributed.tp_size=2", "model.qkv_bias=true",
     "peft={rank: 4, target_modules: [experts.down_proj, q_proj], dropout: 0, freeze: [norms]}"],
    ["moe_ep_cpu.yaml", "--world-size", "2", "distributed.strategy=megatron_fsdp", "distributed.ep_size=1",
     "peft={rank: 4, target_modules: ['*'], dropout: 0}"],
    # two block shapes (dense, then MoE), latent attention under TP, balancing loads under EP
    ["tiny_cpu.yaml", "--world-size", "8", "model.preset=tiny_deepseek", "model.n_layers=3", "distributed.tp_size=2",
     "distributed.ep_size=2", "model.router_bias_update_rate=0.01"],
]


@pytest.mark.parametrize("argv", PLANS, ids=[" ".join(a[:1] + a[3:]) for a in PLANS])
def test_plan_equals_the_meta_model_path(argv, capsys, monkeypatch):
    argv = [str(ROOT / "examples" / argv[0]), *argv[1:]]
    described = _plan_json(capsys, argv)
    monkeypatch.setattr(models, "plan_modules", meta_modules)  # the planner as it was: the meta-device model
    monkeypatch.setattr(tp_plan, "plan_modules", meta_modules)
    assert _plan_json(capsys, argv) == described


@pytest.mark.parametrize("over", [["model.preset=tiny_moe", "model.n_layers=3"],
                                  ["model.preset=tiny_deepseek", "model.n_layers=5", "model.first_k_dense=2"]])
def test_plan_modules_stand_in_for_every_block(over):
    cfg = config(over).model
    (_, modules), (_, described) = meta_modules(cfg), plan_modules(cfg)
    assert list(described) == list(modules)
    assert {n: getattr(m, "kind", None) for n, m in described.items()} == \
        {n: type(m).__name__ for n, m in modules.items()}
    # each block stands under its own shape: the whole model's modules, names and parameter shapes
    whole = build_model(resolve_model_args(cfg), device="meta")
    assert sorted(described) == sorted(n for n, _ in whole.named_modules())
    for name, mod in whole.named_modules():
        assert [(n, tuple(p.shape)) for n, p in mod.named_parameters(recurse=False)] == \
            [(n, tuple(p.shape)) for n, p in described[name].named_parameters(recurse=False)], name


@pytest.mark.slow  # a fresh interpreter and a 1024-rank --fit search (plan without torch, fast tier: test_scale_cli)
def test_plan_of_the_70b_example_imports_no_torch():
    # and a LoRA plan after it (the adapters are described without torch too)
    code = ("import sys; from meshforge.cli import main; "
            f"rc = main(['plan', {str(ROOT / 'examples' / 'llama3_70b_tp_pp.yaml')!r}, '--world-size', '1024', "
            "'--fit']); assert rc == 0, rc; "
            f"rc = main(['plan', {str(ROOT / 'examples' / 'lora_tiny_cpu.yaml')!r}, '--world-size', '1']); "
            "assert rc == 0, rc; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fastest layouts that fit" in out.stdout
