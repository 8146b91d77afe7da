"""The Llama model: shapes, causality, published parameter counts, deterministic init."""

import pytest
import torch

from meshforge.config.schema import ModelConfig
from meshforge.models import build_model, init_weights, param_init_tensor


def tiny(**kw):
    m = build_model(ModelConfig(preset="tiny", **kw))
    init_weights(m, seed=3)
    return m


def test_shapes_and_dtype():
    m = tiny()
    out = m(torch.randint(0, 256, (3, 17)))
    assert out.shape == (3, 17, 256) and out.dtype == torch.float32


def test_causality_later_token_never_changes_earlier_logits():
    m = tiny()
    x = torch.randint(0, 256, (2, 24))
    base = m(x)
    for pos in (5, 12, 23):
        y = x.clone()
        y[:, pos] = (y[:, pos] + 17) % 256
        out = m(y)
        torch.testing.assert_close(out[:, :pos], base[:, :pos], rtol=0, atol=0)
        assert not torch.allclose(out[:, pos:], base[:, pos:])


@pytest.mark.parametrize("preset, published", [
    ("llama3_2_1b", 1_235_814_400),   # Llama 3.2 1B (tied embeddings)
    ("llama3_8b", 8_030_261_248),     # Llama 3 8B
    ("llama3_70b", 70_553_706_496),   # Llama 3 70B
])
def test_preset_parameter_counts_match_published(preset, published):
    m = build_model(ModelConfig(preset=preset), device="meta")
    n = sum(p.numel() for p in m.parameters())  # tied weights counted once
    assert n == published


def test_field_overrides_and_gqa_validation():
    m = build_model(ModelConfig(preset="tiny", n_layers=3, dim=96, n_heads=6, n_kv_heads=3), device="meta")
    assert len(m.blocks()) == 3 and m.layers["0"].attention.wk.weight.shape == (3 * 16, 96)
    with pytest.raises(ValueError, match="n_kv_heads"):
        build_model(ModelConfig(preset="tiny", n_heads=4, n_kv_heads=3), device="meta")


def test_tied_embeddings_share_one_tensor():
    m = tiny(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight


def test_init_is_a_function_of_seed_and_name_only():
    a, b = tiny(), tiny()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    # a meta-built model initialised parameter by parameter equals the eager one
    full = param_init_tensor(a, "layers.1.attention.wq.weight", (64, 64), seed=3)
    assert torch.equal(full, a.layers["1"].attention.wq.weight)
    c = build_model(ModelConfig(preset="tiny"))
    init_weights(c, seed=4)
    assert not torch.equal(c.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)
    assert torch.all(a.norm.weight == 1)


def test_rope_theta_changes_output_and_positions_are_respected():
    x = torch.randint(0, 256, (1, 16))
    a, b = tiny(), tiny(rope_theta=500000.0)
    assert not torch.allclose(a(x), b(x))
    # explicit positions equal to the default arange give identical logits
    torch.testing.assert_close(a(x, torch.arange(16)), a(x), rtol=0, atol=0)


def test_flops_per_token_counts_matmuls_and_attention():
    m = build_model(ModelConfig(preset="llama3_8b"), device="meta")
    f = m.flops_per_token(8192)
    n_matmul = 8_030_261_248 - 128256 * 4096 - 4096 * 65  # minus embedding lookup and norms
    assert f == pytest.approx(6 * n_matmul + 6 * 32 * 32 * 128 * 8192, rel=1e-9)
