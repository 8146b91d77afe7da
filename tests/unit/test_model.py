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


@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
def test_fused_norm_and_swiglu_equal_the_plain_expressions_and_keep_less(dtype, wdtype):
    """The RMSNorm and SwiGLU autograd functions compute what the plain expressions compute (forward bitwise;
    SwiGLU's gradients bitwise, the norm's within fp32 rounding) while autograd keeps only their inputs (and
    the norm's fp32 rsqrt): the saved-tensor counts the planner relies on."""
    from torch.autograd.graph import saved_tensors_hooks

    from meshforge.models.llama import RMSNorm, swiglu

    def kept(fn, *inputs):
        seen = {}
        with saved_tensors_hooks(lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.nbytes) and t,
                                 lambda t: t):
            out = fn(*inputs)
        return out, sum(seen.values())

    torch.manual_seed(0)
    x = torch.randn(2, 16, 64).to(dtype).requires_grad_()
    norm = RMSNorm(64).to(wdtype)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.1 * torch.randn(64).to(wdtype))
    xf = x.float()
    plain = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight
    out, nbytes = kept(norm, x)
    # its input, one fp32 rsqrt per token, and the weight it scales by (a parameter, no new memory)
    assert torch.equal(out, plain) and nbytes == x.nbytes + 2 * 16 * 4 + norm.weight.nbytes
    go = torch.randn_like(out)
    want = torch.autograd.grad(plain, (x, norm.weight), go)
    got = torch.autograd.grad(out, (x, norm.weight), go)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)

    g_, u_ = (torch.randn(2, 16, 96).to(dtype).requires_grad_() for _ in range(2))
    plain = torch.nn.functional.silu(g_) * u_
    out, nbytes = kept(swiglu, g_, u_)
    assert torch.equal(out, plain) and nbytes == g_.nbytes + u_.nbytes  # not silu(gate)
    go = torch.randn_like(out)
    for w, g in zip(torch.autograd.grad(plain, (g_, u_), go), torch.autograd.grad(out, (g_, u_), go)):
        assert torch.equal(g, w)
