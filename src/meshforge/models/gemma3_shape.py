"""Gemma 3's text decoder described without torch (models/shapes.py's style): what models/gemma3.py builds and the
planner reads.

A block is Llama's with a norm after each sub-layer as well as before (`post_attention_norm`, `post_ffn_norm`),
zero-centred RMSNorm weights (the scale is 1 + w) everywhere, QK-norm, a GeGLU MLP (tanh-approximated GELU), and
attention scaled by `query_pre_attn_scalar`^-1/2 with a sliding window on the local layers (five in six).
"""

from __future__ import annotations

from meshforge.models import shapes
from meshforge.models.args import ModelArgs
from meshforge.models.layer_types import window_of
from meshforge.models.protocol import AdapterLayout
from meshforge.models.shapes import ModelShape, ModuleShape, ParamShape, linear


def norm(dim: int, eps: float) -> ModuleShape:
    """RMSNorm scaling by (1 + weight)."""
    return ModuleShape("ZeroCenteredRMSNorm", {"weight": ParamShape((dim,))}, init=(dim, eps))


def attention_scale(a: ModelArgs) -> float | None:
    """The softmax scale, query_pre_attn_scalar^-1/2 (None: the usual head_dim^-1/2)."""
    return None if a.query_pre_attn_scalar is None else float(a.query_pre_attn_scalar) ** -0.5


def attention(a: ModelArgs, layer: int) -> ModuleShape:
    b = a.attention_bias
    children = {"wq": linear(a.dim, a.n_heads * a.hd, b), "wk": linear(a.dim, a.n_kv_heads * a.hd, b),
                "wv": linear(a.dim, a.n_kv_heads * a.hd, b), "wo": linear(a.n_heads * a.hd, a.dim, b),
                "core": ModuleShape("CoreAttention", init=(window_of(a, layer), attention_scale(a))),
                "q_norm": norm(a.hd, a.norm_eps), "k_norm": norm(a.hd, a.norm_eps)}
    return ModuleShape("Gemma3Attention", children=children, init=(a, layer))


def feed_forward(dim: int, hidden: int) -> ModuleShape:
    """GeGLU: w1 (gate, through the tanh GELU), w2 (down), w3 (up)."""
    return ModuleShape("GeGLU", children={"w1": linear(dim, hidden), "w2": linear(hidden, dim),
                                          "w3": linear(dim, hidden)}, init=(dim, hidden))


def block(a: ModelArgs, layer: int) -> ModuleShape:
    d, eps = a.dim, a.norm_eps
    return ModuleShape("Gemma3Block", children={
        "attention_norm": norm(d, eps), "attention": attention(a, layer), "post_attention_norm": norm(d, eps),
        "ffn_norm": norm(d, eps), "feed_forward": feed_forward(d, a.ffn_dim), "post_ffn_norm": norm(d, eps)},
        init=(a, layer))


class Gemma3Shape(ModelShape):
    def block(self, args: ModelArgs, layer: int) -> ModuleShape:
        return block(args, layer)

    def final_norm(self, args: ModelArgs) -> ModuleShape:
        return norm(args.dim, args.norm_eps)

    def model_kind(self, args: ModelArgs) -> str:
        return "Gemma3"

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(sequence_parallel)

    def adapter_layout(self) -> AdapterLayout:
        return adapter_layout(self.args)


def describe(args: ModelArgs) -> Gemma3Shape:
    """The model's description; its FLOPs are Llama's (a GeGLU multiplies as a SwiGLU), each layer's attention
    over the keys its window sees (models/shapes.py)."""
    return Gemma3Shape(args)


def tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """Llama's plan (QK-norm on the local heads with its gradient summed over tp), and with sequence parallelism
    the two post-norms sequence-sharded like the pre-norms."""
    plan = {**shapes.dense_tp_plan(sequence_parallel), "layers.*.attention.q_norm": "head_norm",
            "layers.*.attention.k_norm": "head_norm"}
    if sequence_parallel:
        plan.update({"layers.*.post_attention_norm": "sequence_parallel_residual",
                     "layers.*.post_ffn_norm": "sequence_parallel_residual"})
    return plan


def adapter_layout(a: ModelArgs) -> AdapterLayout:
    dense = shapes.adapter_layout(a)
    return AdapterLayout(linears=dense.linears, embeddings=dense.embeddings,
                         norms=dense.norms + ("layers.*.post_attention_norm", "layers.*.post_ffn_norm"))
