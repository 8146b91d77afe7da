"""A Llama-3-style decoder in plain PyTorch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

No distributed code lives here. The model implements the model contract (`models/protocol.py`): it
*declares* its blocks, TP plan, pipeline layout, attention slots, initialisation, FLOPs and Hugging Face
adapter, and the packages above apply them. Layers live in a `ModuleDict` keyed "0", "1", ... so that a
pipeline stage that holds only some of them keeps the whole model's parameter names (checkpoints move
between PP and non-PP runs without renaming).

Each module's children and parameters are those of its torch-free description (models/shapes.py, which the
planner reads): `__init__` builds them from it (models/materialize.py), and this file says how they compute.

The attention kernel is a swappable `CoreAttention` module (an attention slot), so context parallelism
can replace it without the model knowing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models import rope, shapes
from meshforge.models.args import ModelArgs
from meshforge.models.attention import attend, document_mask, masked_attention
from meshforge.models.hf_families import dense_adapter
from meshforge.models.kv_cache import KVCache, LayerCache
from meshforge.models.layer_types import global_rope
from meshforge.models.loss import HeadInput, head_input
from meshforge.models.materialize import buildable, build_children
from meshforge.models.protocol import AdapterLayout, InitSpec, PipelineLayout, StateDictAdapter


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm that keeps only its input and the fp32 reciprocal RMS for backward.

    Autograd on the plain expression keeps the normalised tensor too, and for a bf16 input its fp32 upcast
    (3-4 bytes more per element per norm): at Llama 3 405B's TP 8 layout that alone is 8 KB per token and layer.
    The forward is the expression itself (Hugging Face's rounding: normalise in fp32, cast, scale); the backward
    recomputes the normalised values from what it kept.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        nf = x.float() * rstd
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (grad * nf.type_as(x)).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:
            gn = (grad * weight).type_as(x).float()
            gx = (rstd * (gn - nf * (gn * nf).mean(-1, keepdim=True))).type_as(x)
        return gx, gw, None


@buildable
class RMSNorm(nn.Module):
    """x / rms(x) * weight (`_RMSNormFn`: Llama's rounding, normalised in fp32, cast, then scaled). With
    `zero_centred` (Gemma 3's norm, transformers' Gemma3RMSNorm) the scale is 1 + weight, weight starting at 0,
    and the whole expression runs in fp32 and is cast once, as transformers computes it."""

    def __init__(self, dim: int, eps: float = 1e-5, zero_centred: bool = False):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centred:
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (out * (1.0 + self.weight.float())).type_as(x)
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up keeping gate and up only: the plain expression also keeps silu(gate), one more
    ffn-wide tensor per layer. Gradients are autograd's own formulas (`silu_backward`), so they are bitwise
    equal to the unfused expression's."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        g_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return g_gate, g_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLUFn.apply(gate, up)


def rope_cos_sin(positions: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the model's rotary table (`rope_type` and its parameters: models/rope.py) for true token
    positions (shape (..., S, head_dim/2)); positions may be non-contiguous (CP)."""
    return rope.tables(positions, args.hd, global_rope(args))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D) with interleaved pairs, as Meta's reference implementation."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    if cos.dim() == 2:  # (S, D/2) -> broadcast over batch and heads
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:  # (B, S, D/2)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


@buildable
class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention on (B, H, S, D); context parallelism swaps this module. `mask` (packed
    sequences, `document_mask`) replaces the causal mask: a FlexAttention block mask on CUDA, a dense boolean mask
    elsewhere (models/attention.py). A layer with its own rule (Gemma 3, GPT-OSS) gives its sliding `window` and
    softmax `scale` here and its attention `sinks` (this rank's heads) to forward (`attention.attend`); the drop-in
    of context parallelism takes the same (`window`, `scale` read from the module it replaces)."""

    def __init__(self, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.window, self.scale = window, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.window is None and self.scale is None and sinks is None:
            if mask is not None:
                return masked_attention(q, k, v, mask)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return attend(q, k, v, mask, window=self.window, scale=self.scale, sinks=sinks)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in (("window", self.window), ("scale", self.scale)) if v is not None)


@buildable
class AttentionSinks(nn.Module):
    """GPT-OSS's attention sinks: one learned logit per query head (`weight` (heads,)); tensor parallelism splits
    it with the heads (style `local_heads`: forward then sees this rank's)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


@buildable
class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.hd
        build_children(self, shapes.attention(args))  # wq, wk, wv, wo, core; q_norm, k_norm (Qwen3)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                cache: LayerCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:  # incremental decoding: attend over the cached tokens too (models/kv_cache.py)
            k, v = cache.append(k, v)
        if hasattr(self, "sinks"):  # GPT-OSS: a learned per-head logit in every softmax (this rank's heads)
            out = self.core(q, k, v, mask, sinks=self.sinks())
        else:
            out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


@buildable
class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        build_children(self, shapes.feed_forward(dim, hidden))  # w1, w2, w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


@buildable
class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        # attention_norm, attention, ffn_norm, feed_forward (a FeedForward, or an MoE with experts)
        build_children(self, shapes.block(args))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                cache: LayerCache | None = None, in_document: torch.Tensor | None = None) -> torch.Tensor:
        """`in_document` (packed sequences, an MoE feed-forward only): (B, S) True where a token belongs to a
        document, so padding never reaches the router's statistics."""
        attn_in = self.attention_norm(x)
        h = x + (self.attention(attn_in, cos, sin, mask) if cache is None else
                 self.attention(attn_in, cos, sin, mask, cache))
        ff_in = self.ffn_norm(h)
        return h + (self.feed_forward(ff_in) if in_document is None else self.feed_forward(ff_in, in_document))


def cache_mask(cache: KVCache | None, tokens: torch.Tensor, document_ids: torch.Tensor | None):
    """The attention mask of a forward: the cache's (causal over cached + new tokens, padding hidden), the packed
    sequences' document mask, or None (plain causal)."""
    if cache is not None:
        return cache.attention_mask(tokens.shape[1])
    return None if document_ids is None else document_mask(document_ids)


def block_forward(block: nn.Module, h: torch.Tensor, cos, sin, mask, cache: KVCache | None, i: int,
                  in_document: torch.Tensor | None = None) -> torch.Tensor:
    """Block `i` on `h`, passing only the arguments in use (wrappers see training's exact call); `in_document`
    (packed sequences, for a block whose feed-forward is an MoE): see `TransformerBlock.forward`."""
    if cache is not None:
        return block(h, cos, sin, mask, cache.at(i))
    if in_document is not None:
        return block(h, cos, sin, mask, in_document=in_document)
    return block(h, cos, sin) if mask is None else block(h, cos, sin, mask)


class Llama(nn.Module):
    block_cls = TransformerBlock
    fused_loss = False  # forward returns a `HeadInput` (hidden states + head weight) instead of logits
    # a pipeline stage sets the ends it does not hold to None
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: RMSNorm | None
    output: nn.Linear | None  # its weight is the embedding's with model.tie_embeddings

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        build_children(self, shapes.describe(args))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """tokens: (B, S) ids on the first stage, (B, S, dim) hidden states on later pipeline stages.
        document_ids: (B, S), for packed sequences: attention stays within a document (`positions` restart).
        cache (generation): the keys/values of the tokens before these, and which positions are padding."""
        if positions is None:  # from the input: a sequence-parallel embedding returns a sequence shard
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = rope_cos_sin(positions, self.args)
        mask = cache_mask(cache, tokens, document_ids)
        for i, block in enumerate(self.layers.values()):
            h = block_forward(block, h, cos, sin, mask, cache, i)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h)

    def head(self, h: torch.Tensor) -> torch.Tensor | HeadInput:
        """Logits; in training with the fused loss on, the head's input for the loss to project chunk by chunk
        (in eval mode always logits, for generation and any caller; a head replaced by a wrapper, e.g. LoRA or
        float8, has its own forward, so it computes logits as usual)."""
        if self.output is None:
            return h
        if self.fused_loss and self.training and type(self.output) is nn.Linear:  # eval: logits, for any caller
            return head_input(h, self.output.weight)
        return self.output(h)

    # ------------------------------------------------------------ declared plans
    def set_fused_loss(self, enabled: bool) -> bool:
        self.fused_loss = enabled
        return True

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: the unit FSDP wraps, activation checkpointing recomputes."""
        return list(self.layers.values())

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        """Module-name patterns -> tensor-parallel style; interpreted by distributed/tensor_parallel.py."""
        return shapes.tp_plan(self.args, sequence_parallel)  # declared in models/shapes.py, which the planner reads

    def pipeline_layout(self) -> PipelineLayout:
        """The blocks, in order, are the split points; the embedding goes with the first stage and the final
        norm + output with the last."""
        return PipelineLayout(tuple(f"layers.{k}" for k in self.layers), ("tok_embeddings",), ("norm", "output"))

    def attention_slots(self) -> list[str]:
        return [f"layers.{k}.attention.core" for k in self.layers]

    def moe_layers(self) -> list[nn.Module]:
        return []

    def init_spec(self, name: str) -> InitSpec:
        """How parameter `name` is initialised: normal(std), ones (norms)."""
        if name.endswith("norm.weight"):
            return InitSpec("ones")
        if name.endswith(".bias"):
            return InitSpec("zeros")
        std = self.args.init_std
        if name.endswith(("wo.weight", "w2.weight")):
            std = std / math.sqrt(2 * self.args.n_layers)  # residual projections, GPT-2 style
        return InitSpec("normal", std)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (models/shapes.py: the planner computes them without building the model)."""
        return shapes.flops_per_token(self.args, seq_len)

    def state_dict_adapter(self) -> StateDictAdapter:
        return dense_adapter(self.args)

    def adapter_layout(self) -> AdapterLayout | None:
        """The projections by their Hugging Face role names (LoRA's `target_modules`), embeddings, norms."""
        return shapes.adapter_layout(self.args)  # declared in models/shapes.py, which the planner reads
