"""`model.hf_model` with mixture-of-experts models and tensor parallelism, against the real transformers, fast:

- The seeded random start has transformers' own `_init_weights` distributions (fused experts and routers too):
  constants and deterministic values equal, random ones with the same mean and spread; it is a function of the
  seed only.
- MoE folder weights (transformers 5 writes the experts per expert, keeps them fused in memory) load exactly.
- The router's auxiliary loss (`output_router_logits: true`) is added as transformers adds it: training equals the
  plain transformers loop, and differs from a run without it.
- Expert parallelism is refused in one line for experts without transformers' fused interface.
- The TP check by a traced forward (planning/tp_trace.py): Cohere's per-head q/k norms are split with their heads;
  a (head_dim,) norm applied per head (partial gradient) and a plan that leaves a projection whole are refused in
  one line naming it.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from meshforge.config.loader import apply_overrides, resolve  # noqa: E402
from meshforge.errors import ConfigError  # noqa: E402
from meshforge.models import build_model, init_weights, load_folder_weights, resolve_model_args  # noqa: E402
from meshforge.planning.tp_plan import resolve_plan  # noqa: E402
from meshforge.planning.tp_trace import trace_plan  # noqa: E402
from meshforge.testing.parity import config  # noqa: E402
from tests.checkpoint.hf_zoo import SHORT, tiny_config, train_against_transformers, write_tiny  # noqa: E402


def _problems(folder, extra: list[str], world_size: int = 2) -> list[str]:
    raw = apply_overrides({}, ["data.source=synthetic", f"model.hf_model={folder}", *SHORT, *extra])
    try:
        resolve(raw, world_size=world_size)
        return []
    except ConfigError as err:
        return list(err.problems)


def _ours(folder, seed: int = 0) -> dict[str, torch.Tensor]:
    model = build_model(resolve_model_args(config([f"model.hf_model={folder}"], world_size=1).model))
    init_weights(model, seed)
    return {k.removeprefix("hf."): v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt2", "falcon_mamba"])
def test_seeded_start_has_transformers_distributions(tmp_path, model_type):
    """qwen3_moe: fused experts and routers (normal(initializer_range)); gpt2: residual projections scaled by
    1/sqrt(2 x layers) by the parent module's init; falcon_mamba: A_log = log(1..N), D ones."""
    folder = write_tiny(model_type, tmp_path / model_type)
    config_ = transformers.AutoConfig.from_pretrained(folder)
    theirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        theirs.append(transformers.AutoModelForCausalLM.from_config(config_).state_dict())
    ours, again, other = _ours(folder, 0), _ours(folder, 0), _ours(folder, 1)
    checked = 0
    for name, t in theirs[0].items():
        if not t.is_floating_point() or name not in ours:
            continue  # (buffers)
        assert torch.equal(ours[name], again[name]), name  # a function of the seed
        if torch.equal(t, theirs[1][name]):  # transformers' value does not depend on the RNG: the same value
            assert torch.equal(ours[name], t), name
            continue
        assert not torch.equal(ours[name], other[name]), name
        n = t.numel()
        std_t, std_o = t.float().std().item(), ours[name].float().std().item()
        assert abs(std_o / std_t - 1) < 6 / n**0.5 + 0.02, (name, std_o, std_t)
        assert abs(ours[name].float().mean().item() - t.float().mean().item()) < 6 * std_t / n**0.5, name
        checked += 1
    assert checked >= 5
    if model_type == "qwen3_moe":
        experts = ours["model.layers.0.mlp.experts.gate_up_proj"]
        assert abs(experts.std().item() - config_.initializer_range) < 1e-3
        assert ours["model.layers.0.mlp.gate.weight"].std().item() > 0  # the router: normal, not its zeros


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_folder_weights_give_transformers_logits(tmp_path, model_type):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # noqa: SIM118  (on disk per expert, fused in memory)
    ours = build_model(resolve_model_args(config([f"model.hf_model={tmp_path / 'm'}"], world_size=1).model))
    init_weights(ours, 0)
    assert load_folder_weights(ours)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - hf.eval()(tokens).logits).abs().max().item()
    print(f"{model_type} folder weights: max |logit diff| vs transformers {diff:.2e}")
    assert diff == 0.0


def test_router_aux_loss_is_added_as_transformers_adds_it(tmp_path):
    with_aux = tiny_config("mixtral")
    with_aux.output_router_logits, with_aux.router_aux_loss_coef = True, 0.5
    with_aux.save_pretrained(tmp_path / "aux")
    res = train_against_transformers(tmp_path / "aux", 2)
    assert res["loss_rel"] <= 1e-6 and res["weight_abs"] <= 1e-6, res
    without = write_tiny("mixtral", tmp_path / "plain")
    assert train_against_transformers(without, 2)["losses"][1] != res["losses"][1]  # the aux loss trained the router


@pytest.mark.parametrize("model_type", ["dbrx", "jetmoe"])
def test_ep_refused_for_experts_without_the_fused_interface(tmp_path, model_type):
    folder = write_tiny(model_type, tmp_path / model_type)
    problems = _problems(folder, ["distributed.strategy=fsdp2", "distributed.ep_size=2"])
    mine = [p for p in problems if p.startswith("distributed.ep_size=2 with model.hf_model")]
    assert len(mine) == 1 and "transformers' fused experts interface" in mine[0] and "\n" not in mine[0], problems
    dense = write_tiny("llama", tmp_path / "llama")
    assert any("no experts module" in p for p in _problems(dense, ["distributed.strategy=fsdp2",
                                                                   "distributed.ep_size=2"]))


def test_per_head_norms_are_split_with_their_heads(tmp_path):
    """Cohere's q/k LayerNorms (heads, head_dim) that transformers' plan leaves whole: validation passes at TP2
    (the trace splits them, `local_heads`); a shape error after launch before this (issue 32)."""
    cohere = tiny_config("cohere")  # use_qk_norm: true
    cohere.pad_token_id = None  # (a padding row is refused with TP: a separate matter)
    cohere.save_pretrained(folder := tmp_path / "cohere")
    assert _problems(folder, ["distributed.strategy=fsdp2", "distributed.tp_size=2"]) == []
    model = build_model(resolve_model_args(config([f"model.hf_model={folder}"], world_size=1).model))
    resolved, _, _ = resolve_plan(model, False, None)
    added, problems = trace_plan(model, resolved, 2)
    assert problems == []
    assert set(added) == {f"hf.model.layers.{i}.self_attn.{n}_norm" for i in range(2) for n in "qk"}
    assert set(added.values()) == {"local_heads"}


def test_a_whole_parameter_on_sharded_activations_is_refused():
    """The built-in model with per-head RMSNorms of q and k (weight (head_dim,)) that a config plan leaves whole
    (`replicate`, over the model's own `head_norm`, which sums their gradient over tp): each tp rank would get
    only its heads' share of their gradient; refused naming them, once for all layers."""
    model = build_model(resolve_model_args(config(["model.qk_norm=true"], world_size=1).model))
    whole = {"layers.*.attention.q_norm": "replicate", "layers.*.attention.k_norm": "replicate"}
    resolved, _, _ = resolve_plan(model, False, whole)
    added, problems = trace_plan(model, resolved, 2)
    assert added == {}
    assert len(problems) == 2 and all("(in 2 layers)" in p and "only its share of its gradient" in p
                                      for p in problems), problems
    assert "'layers.*.attention.q_norm.weight'" in problems[1]


def test_a_projection_the_plan_leaves_whole_is_refused(tmp_path):
    """distributed.tp_plan setting Qwen2's o_proj to replicate after column-wise q/k/v: refused in validation,
    naming o_proj, never a shape error after launch."""
    folder = write_tiny("qwen2", tmp_path / "qwen2")
    problems = _problems(folder, ["distributed.strategy=fsdp2", "distributed.tp_size=2",
                                  "distributed.tp_plan={hf.model.layers.*.self_attn.o_proj: replicate}"])
    mine = [p for p in problems if p.startswith("tensor parallelism:")]
    assert len(mine) == 1 and "o_proj" in mine[0] and "\n" not in mine[0], problems
    print(mine[0])
