"""LoRA (models/lora.py, the `peft:` section): what is adapted, what is frozen, what trains, what is refused."""

from __future__ import annotations

import pytest
import torch

from meshforge.config import load_config
from meshforge.config.rules import check
from meshforge.models import build_model, init_weights
from meshforge.models.lora import LoRALinear, apply_lora, merge_lora
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import Trainer

ALL = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def _problems(*overrides: str, world_size: int = 2) -> list[str]:
    return check(load_config(None, ["model.preset=tiny", *overrides]), world_size)


def test_targets_resolve_by_role_and_pattern():
    cfg = load_config(None, ["peft.rank=4", "peft.target_modules=['*_proj']"])
    model = build_model(cfg.model, device="meta")
    names = apply_lora(model, cfg.peft)
    assert len(names) == 7 * model.args.n_layers
    assert all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    cfg = load_config(None, ["peft.target_modules=[v_proj]"])
    model = build_model(cfg.model, device="meta")
    assert apply_lora(model, cfg.peft) == [f"layers.{i}.attention.wv" for i in range(model.args.n_layers)]


@pytest.mark.parametrize("overrides,needle", [
    (["peft.target_modules=[q_proj,qkv]"], "peft.target_modules: 'qkv' matches none"),
    (["peft.rank=4", "model.preset=tiny_moe", "peft.dropout=0.1", "peft.target_modules=[q_proj,'experts.*']"],
     "peft.dropout=0.1 with expert adapters (experts.gate_up_proj, experts.down_proj)"),
    (["peft.rank=4", "model.preset=tiny_moe", "peft.target_modules=[gate_proj]"], "experts.gate_up_proj"),
    (["peft.rank=4", "checkpoint.save_consolidated=final"], "export --adapter"),
])
def test_what_is_not_built_is_refused_in_one_line(overrides, needle):
    try:
        problems = _problems(*overrides)
    except Exception as err:  # noqa: BLE001 - a schema-level refusal is as good
        problems = str(err).splitlines()
    hits = [p for p in problems if needle in p]
    assert hits and all("\n" not in p for p in hits), problems


def test_a_model_without_adapter_layout_is_refused():
    from meshforge.models.lora import layout_of

    with pytest.raises(ValueError, match="declares no adapter layout"):
        layout_of(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_expert_adapters_start_at_the_base_and_merge_exactly():
    """Per-expert adapters on grouped experts (tiny_moe, both paths: grouped mm and the per-expert loop)."""
    from meshforge.models.moe import GroupedExperts

    cfg = load_config(None, ["model.preset=tiny_moe", "peft.rank=4", "peft.target_modules=['experts.*']"])
    base = build_model(cfg.model)
    init_weights(base, seed=3)
    model = build_model(cfg.model)
    apply_lora(model, cfg.peft)
    init_weights(model, seed=3)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 4 * model.args.n_layers and all(".lora_" in k for k in trainable)
    x = torch.randint(0, 256, (2, 16))
    model.eval()
    base.eval()
    assert torch.equal(model(x), base(x))
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_B" in k:
                p.normal_(0, 0.05)
        adapted = model(x)
        GroupedExperts.use_grouped_mm = False
        try:
            torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
        finally:
            GroupedExperts.use_grouped_mm = True
        merge_lora(model)
        assert not any(".lora_" in k for k, _ in model.named_parameters())
        torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
        assert (adapted - base(x)).abs().max() > 1e-3


def test_unadapted_start_equals_base_and_merge_is_exact():
    cfg = load_config(None, ["peft.rank=4", ALL])
    base = build_model(cfg.model)
    init_weights(base, seed=3)
    model = build_model(cfg.model)
    apply_lora(model, cfg.peft)
    init_weights(model, seed=3)  # B starts at zero: the adapted model is the base
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(model(x), base(x))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
        adapted = model(x)
        merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in model.modules())
        torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
        assert (adapted - base(x)).abs().max() > 1e-3


def _run(overrides: list[str], steps: int = 3):
    tr = Trainer.build(config(["peft.rank=4", *overrides], steps=steps, world_size=1), single_info())
    init = {k: v.detach().clone() for k, v in tr.pm.model.named_parameters()}
    tr.fit()
    return tr, init


def test_only_adapters_train_base_bitwise_unchanged_no_optimizer_state_for_it():
    tr, init = _run([ALL])
    params = dict(tr.pm.model.named_parameters())
    trainable = {k for k, p in params.items() if p.requires_grad}
    assert trainable and all(".lora_A." in k or ".lora_B." in k for k in trainable)
    for k, p in params.items():
        if k not in trainable:
            assert torch.equal(p, init[k]), f"frozen {k} changed"
    assert any(not torch.equal(params[k], init[k]) for k in trainable if "lora_B" in k)
    in_optimizer = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(params[k]) for k in trainable}
    assert {id(p) for p in tr.optimizer.state} <= in_optimizer


def test_freeze_policy_trains_the_norms_it_does_not_list():
    tr, init = _run(["peft.target_modules=[v_proj]", "peft.freeze=[embeddings]"], steps=2)
    params = dict(tr.pm.model.named_parameters())
    assert params["norm.weight"].requires_grad and not torch.equal(params["norm.weight"], init["norm.weight"])
    assert not params["tok_embeddings.weight"].requires_grad
    assert torch.equal(params["tok_embeddings.weight"], init["tok_embeddings.weight"])


@pytest.mark.parametrize("strategy", ["fsdp2", "megatron_fsdp"])
@pytest.mark.parametrize("overrides", [["peft.rank=16"], []])
def test_state_bytes_accounting_equals_the_bench_measurement(overrides, strategy):
    """The accounting `benchmarks/lora_memory.py` prints for the 1B preset, checked here against the bench's
    measured storages (after an optimizer step, before zero_grad) on the tiny preset; for megatron_fsdp the
    measurement is its buffers' report, where frozen weights have no gradient or fp32 main buffer."""
    from meshforge.bench.measure import state_bytes as measured_state_bytes
    from meshforge.bench.peft_memory import state_bytes

    cfg = config([*overrides, f"distributed.strategy={strategy}"], steps=1, world_size=1)
    tr = Trainer.build(cfg, single_info())
    got: dict = {}
    tr.train_step(clock=lambda part: part == "schedule" and got.update(
        measured_state_bytes(tr.pm.parts, tr.optimizer, tr.pm.strategy)))
    want = state_bytes(cfg.model, cfg.peft, strategy=strategy)
    assert {k: got[k] for k in ("params", "grads", "optimizer", "total")} == \
        {k: want[k] for k in ("params", "grads", "optimizer", "total")}
    if cfg.peft is not None:
        assert want["grads"] < want["params"] / 5
