"""The pieces GPT-OSS and Gemma 3 add, each against its reference: rotary tables against transformers' own
`ROPE_INIT_FUNCTIONS` (bitwise), attention with sinks and windows against transformers' GPT-OSS eager attention,
the closed-form FLOPs against a counted forward and backward (`torch.utils.flop_counter.FlopCounterMode`), and
the layout of layer kinds against transformers' defaults."""

from __future__ import annotations

import pytest
import torch

from meshforge.models import PRESETS, build_model, init_weights
from meshforge.models.attention import allowed, attend
from meshforge.models.layer_types import FULL, SLIDING, RopeSpec, layer_kinds
from meshforge.models.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("spec", [RopeSpec(1e4, "yarn", 4.0, 16, truncate=False),
                                  RopeSpec(150000.0, "yarn", 32.0, 4096, beta_fast=16.0, beta_slow=2.0),
                                  RopeSpec(5e5, "yarn", 8.0, 64, attention_factor=1.3),
                                  RopeSpec(1e6, "linear", 8.0), RopeSpec(5e5, "default")])
def test_rope_tables_equal_transformers(spec):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": spec.kind, "rope_theta": spec.theta}
    if spec.kind != "default":
        params["factor"] = spec.factor
    if spec.kind == "yarn":
        params.update(original_max_position_embeddings=spec.original_max, beta_fast=spec.beta_fast,
                      beta_slow=spec.beta_slow, truncate=spec.truncate)
        if spec.attention_factor is not None:
            params["attention_factor"] = spec.attention_factor
    cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=8192,
                                   rope_parameters=params)
    ours, factor = inverse_frequencies(spec, 64)
    if spec.kind == "default":
        theirs, their_factor = 1.0 / (spec.theta ** (torch.arange(0, 64, 2).float() / 64)), 1.0
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[spec.kind](cfg, "cpu")
    assert torch.equal(ours, theirs) and factor == their_factor


def test_sinks_and_window_equal_transformers_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    b, h, kvh, s, d, window = 2, 8, 2, 24, 16, 5
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, kvh, kvh))
    sinks = torch.randn(h, generator=g)
    ok = allowed(torch.arange(s), torch.arange(s), window)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, h // kvh
    additive = torch.zeros(1, 1, s, s).masked_fill(~ok, torch.finfo(torch.float32).min)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=d ** -0.5)
    ours = attend(q, k, v, window=window, sinks=sinks).transpose(1, 2)
    assert (ours - theirs).abs().max().item() < 1e-6
    # without the sinks the rows sum to one again: a different result
    assert (attend(q, k, v, window=window).transpose(1, 2) - theirs).abs().max().item() > 1e-3


@pytest.mark.parametrize("preset", ["tiny_gemma3", "tiny_gpt_oss"])
def test_flops_per_token_against_a_counted_forward_and_backward(preset, monkeypatch):
    """Matmuls (projections, experts a token visits, router, head) exactly; attention: FlopCounterMode counts the
    full score matrices, the closed form the keys each query sees (causal, windowed), so the counted attention
    scaled by the mask's share of allowed pairs is the closed form's within 1/S (the (S+1)/2 vs S/2 convention)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from meshforge.models.layer_types import window_of
    from meshforge.models.shapes import attention_forward_flops_per_token
    from meshforge.models.loss import lm_loss
    from meshforge.models.moe import GroupedExperts

    monkeypatch.setattr(GroupedExperts, "use_grouped_mm", False)  # per-expert matmuls on the rows each receives
    a = PRESETS[preset]
    m = build_model(a)
    init_weights(m, 0)
    b, s = 2, 64
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, a.vocab_size, (b, s), generator=g) for _ in range(2))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):  # attention as countable bmm
        out = m(x)
        parts = lm_loss(out, y)
        (parts.mean + (parts.aux if parts.aux is not None else 0)).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = b * s
    closed_attention = 3 * attention_forward_flops_per_token(a, s) * tokens
    closed_matmul = m.flops_per_token(s) * tokens - closed_attention
    assert counts.pop("aten.mm") + counts.pop("aten.addmm", 0) == closed_matmul
    full = counts.pop("aten.bmm")
    assert not counts, counts
    share = sum(allowed(torch.arange(s), torch.arange(s), window_of(a, i)).sum().item() / s / s
                for i in range(a.n_layers)) / a.n_layers
    assert abs(full * share - closed_attention) / closed_attention < 1 / s + 1e-3
    assert closed_attention < 0.75 * full / 2  # the window of the local layers counts: far under causal's half


def test_layer_kinds_are_transformers_defaults():
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=13)
    assert layer_kinds(13, 4096, 6) == gemma.layer_types
    oss = transformers.GptOssConfig(num_hidden_layers=5)
    assert layer_kinds(5, 128, 2) == oss.layer_types
    assert layer_kinds(3, None, 2) == [FULL] * 3 and layer_kinds(3, 8, None) == [SLIDING] * 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_window_and_sinks_equal_the_dense_path_on_cuda(dtype, tol, packed):
    """On CUDA a window (and a document mask) is a FlexAttention block mask and the sinks rescale its output by
    the log-sum-exp: forward and the gradients of q, k, v and the sinks equal the dense CPU path."""
    from meshforge.models.attention import dense_document_mask, document_mask

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    b, h, kvh, s, d, window = 2, 8, 2, 256, 64, 40
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n in (h, kvh, kvh))
    sinks = torch.randn(h, generator=g)
    docs = torch.cat([torch.zeros(b, 100, dtype=torch.long), torch.ones(b, s - 100, dtype=torch.long)], 1)
    grads = []
    for device, dt in (("cpu", torch.float32), ("cuda", dtype)):
        ins = [t.to(device, dt).requires_grad_(True) for t in (q, k, v, sinks)]
        mask = None
        if packed:
            mask = document_mask(docs.to(device)) if device == "cuda" else dense_document_mask(docs)
        out = attend(*ins[:3], mask, window=window, sinks=ins[3])
        out.float().pow(2).sum().backward()
        grads.append([out.float().cpu()] + [t.grad.float().cpu() for t in ins])
    for ref, got in zip(*grads):
        assert (ref - got).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
