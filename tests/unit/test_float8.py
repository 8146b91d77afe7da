"""FP8 training (`training.fp8`, torchao float8): which modules convert, the config rules, and a tiny run whose
loss tracks the fp32 run. torchao's float8 matmuls run on CPU (torch 2.13), so this is the real conversion."""

import pytest
import torch

pytest.importorskip("torchao.float8")

from meshforge.config.rules import check  # noqa: E402
from meshforge.config.schema import Config, FP8Config, ModelConfig  # noqa: E402
from meshforge.distributed.float8 import apply_float8  # noqa: E402
from meshforge.errors import ConfigError  # noqa: E402
from meshforge.models import build_model  # noqa: E402
from meshforge.testing.parity import run_single  # noqa: E402


def _float8_names(model):
    return {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


def test_filter_all_converts_every_block_linear_but_never_the_head():
    model = build_model(ModelConfig(preset="tiny"))
    n = apply_float8(model, FP8Config(enabled=True, filter="all"), torch.device("cpu"), fsdp2_sharded=False)
    names = _float8_names(model)
    block_linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers")}
    assert n == len(names) == len(block_linears) == 14 and names == block_linears
    assert type(model.output) is torch.nn.Linear  # the head keeps full precision (and the fused loss)


def test_filter_auto_keeps_small_matmuls_and_refuses_a_model_with_none_to_convert():
    big = build_model(ModelConfig(preset="llama3_2_1b"), device="meta")
    apply_float8(big, FP8Config(enabled=True, recipe="rowwise"), torch.device("cpu"), fsdp2_sharded=False)
    names = _float8_names(big)
    # torchao's H100 rowwise thresholds at dim 2048: only the 2048 -> 8192 projections gain; never the head
    assert names == {f"layers.{i}.feed_forward.w{j}" for i in range(16) for j in (1, 3)}
    with pytest.raises(ConfigError, match="training.fp8: no linear layer of the model qualifies"):
        apply_float8(build_model(ModelConfig(preset="tiny")), FP8Config(enabled=True), torch.device("cpu"), False)


def test_lora_adapted_linears_and_factors_stay_in_high_precision():
    """torchao rebuilds a converted module as a Float8Linear: a LoRA-adapted linear lost its adapters (with
    filter=all every trainable parameter of the model, silently). Adapted linears and LoRA's factors stay."""
    from meshforge.config.schema import PeftConfig
    from meshforge.models.lora import adapter_modules, apply_lora

    model = build_model(ModelConfig(preset="tiny"))
    apply_lora(model, PeftConfig(rank=16, target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    apply_float8(model, FP8Config(enabled=True, filter="all"), torch.device("cpu"), fsdp2_sharded=False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable and len(trainable) == 8
    assert set(adapter_modules(model)) == {f"layers.{i}.attention.w{r}" for i in range(2) for r in "qv"}
    assert _float8_names(model) == {f"layers.{i}.{m}" for i in range(2) for m in (
        "attention.wk", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}


def test_fp8_rules_take_tp_and_pp_and_refuse_rowwise_tp_and_old_gpus(monkeypatch):
    for dist, ws in (({"tp_size": 2}, 2), ({"tp_size": 2, "sequence_parallel": True}, 2), ({"pp_size": 2}, 2),
                     ({"pp_size": 2, "tp_size": 2}, 8), ({"strategy": "megatron_fsdp"}, 2)):
        ok = Config.model_validate({"training": {"fp8": {"enabled": True}}, "distributed": dist})
        assert not any("fp8" in p for p in check(ok, ws)), dist
    rowwise = Config.model_validate({"training": {"fp8": {"enabled": True, "recipe": "rowwise"}},
                                     "distributed": {"tp_size": 2}})
    assert [p for p in check(rowwise, 2) if "fp8" in p] == [
        "training.fp8.recipe=rowwise with distributed.tp_size=2 is not supported (torchao's per-row scales on "
        "tensor-parallel shards differ from one process's): set training.fp8.recipe=tensorwise"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        apply_float8(build_model(ModelConfig(preset="tiny")), FP8Config(enabled=True, filter="all"),
                     torch.device("cuda"), False)


# measured over 50 steps on CPU (torch 2.13, torchao 0.18, tiny model, seq 16, one micro batch of 2 a step,
# lr 1e-3): max relative difference per step 1.1e-3, mean 2.7e-4. (At lr 1e-2 the runs drift apart chaotically,
# up to 4e-2 on single steps, mean 1.1e-2, on random tokens that teach nothing.)
FP8_LOSS_RTOL = 5e-3
SHORT = ["training.global_batch_size=2", "training.seq_len=16", "optimizer.lr=1e-3"]


@pytest.mark.slow  # fp8 matmuls are slow on CPU: ~10 s idle
def test_tiny_fp8_run_tracks_fp32_over_50_steps(reference):
    ref = reference(tuple(SHORT), 50)
    got = run_single(SHORT + ["training.fp8.enabled=true", "training.fp8.filter=all"], steps=50, weights=False)
    rel = [abs(a - b) / a for a, b in zip(ref.losses, got.losses, strict=True)]
    assert max(rel) > 0, "fp8 changed nothing: no layer ran in float8"
    assert max(rel) <= FP8_LOSS_RTOL, f"fp8 (tensorwise) loss differs from fp32 by {max(rel):.3e} relative"


def test_fsdp2_sharding_turns_on_float8_all_gather_for_tensorwise_only():
    for recipe, sharded, expect in [("tensorwise", True, True), ("tensorwise", False, False),
                                    ("rowwise", True, False)]:
        model = build_model(ModelConfig(preset="tiny"))
        apply_float8(model, FP8Config(enabled=True, recipe=recipe, filter="all"), torch.device("cpu"), sharded)
        assert model.layers["0"].attention.wq.config.enable_fsdp_float8_all_gather is expect


def test_keep_fp8_transpose_cache_is_inert_and_says_so():
    from meshforge.config import load_config
    from meshforge.config.rules import warnings

    cfg = load_config(None, ["model.preset=tiny", "data.source=synthetic", "distributed.strategy=megatron_fsdp",
                             "distributed.keep_fp8_transpose_cache=true"], world_size=1)
    assert any("keep_fp8_transpose_cache" in w and "no effect" in w for w in warnings(cfg, 1))


def test_tensor_parallel_takes_torchao_float8_styles_for_tensorwise_linears_only():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from meshforge.distributed.float8 import float8_tp_styles
    from meshforge.planning.tp_plan import resolve_plan

    for recipe, sp in (("tensorwise", False), ("tensorwise", True), ("rowwise", False)):
        model = build_model(ModelConfig(preset="tiny"))
        apply_float8(model, FP8Config(enabled=True, filter="all", recipe=recipe), torch.device("cpu"), False)
        resolved = resolve_plan(model, sp, None)[0]
        styles = float8_tp_styles(model, resolved, sp)
        if recipe == "rowwise":  # torch's own styles; the per-row casts happen inside Float8Linear
            assert styles == {}
            continue
        assert {n for n, st in styles.items() if isinstance(st, Float8ColwiseParallel)} == \
            {n for n, st in resolved.items() if st == "colwise"}
        rows = {n for n, st in resolved.items() if st == "rowwise"}
        assert {n for n, st in styles.items() if isinstance(st, Float8RowwiseParallel)} == rows
        assert "output" not in styles and "tok_embeddings" not in styles  # the vocabulary layers stay
    plain = build_model(ModelConfig(preset="tiny"))
    assert float8_tp_styles(plain, resolve_plan(plain, False, None)[0], False) == {}
