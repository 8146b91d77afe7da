"""Gemma 3's text decoder (transformers' `Gemma3ForCausalLM`) in plain PyTorch, from its description
(models/gemma3_shape.py).

What differs from Llama: zero-centred RMSNorm (scale 1 + w, computed in fp32 and cast once, as transformers
does), a norm before and after each sub-layer, QK-norm, a GeGLU MLP with the tanh GELU, the embedding scaled by
sqrt(dim) in the embedding's dtype, attention scaled by query_pre_attn_scalar^-1/2, local layers with a sliding
window and their own rotary base (`model.rope_local_theta`) between global ones (models/layer_types.py), a tied
head by default, and optionally a soft-cap of the final logits (`model.final_logit_softcap`: cap * tanh(x / cap)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models import gemma3_shape
from meshforge.models.args import ModelArgs
from meshforge.models.kv_cache import LayerCache
from meshforge.models.layer_types import rope_of
from meshforge.models.layered import LayeredDecoder
from meshforge.models.llama import Attention
from meshforge.models.materialize import buildable, build_children
from meshforge.models.protocol import InitSpec


@buildable
class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in fp32, cast back to x's dtype (transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


@buildable
class GeGLU(nn.Module):
    """w2(gelu_tanh(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        build_children(self, gemma3_shape.feed_forward(dim, hidden))  # w1, w2, w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


@buildable
class Gemma3Attention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.hd
        build_children(self, gemma3_shape.attention(args, layer))  # wq, wk, wv, wo, core, q_norm, k_norm


@buildable
class Gemma3Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        # attention_norm, attention, post_attention_norm, ffn_norm, feed_forward, post_ffn_norm
        build_children(self, gemma3_shape.block(args, layer))
        self.rope = rope_of(args, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                cache: LayerCache | None = None) -> torch.Tensor:
        attn_in = self.attention_norm(x)
        attn = self.attention(attn_in, cos, sin, mask) if cache is None else self.attention(attn_in, cos, sin, mask,
                                                                                             cache)
        h = x + self.post_attention_norm(attn)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Gemma3(LayeredDecoder):
    description = staticmethod(gemma3_shape.describe)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embed_scale = math.sqrt(args.dim)
        self.logit_softcap = args.final_logit_softcap

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return gemma3_shape.tp_plan(sequence_parallel)

    def init_spec(self, name: str) -> InitSpec:
        if name.endswith("norm.weight"):  # zero-centred: the scale starts at 1
            return InitSpec("zeros")
        return super().init_spec(name)

    def adapter_layout(self):
        return gemma3_shape.adapter_layout(self.args)


def model_class(args: ModelArgs) -> type[Gemma3]:
    return Gemma3
