"""GPT-OSS described without torch (models/shapes.py's style): what models/gpt_oss.py builds and the planner reads.

A block is Llama's pre-norm attention and MoE with four differences: attention has biases on q, k, v, o and one
learned sink logit per head (`attention.sinks`), and is local (a sliding window) on every other layer; the router
gate has a bias; the experts are stored as transformers stores them, the gate and up projections fused and
interleaved (`gate_up_proj` (E, dim, 2 x hidden): gate in the even columns, up in the odd) with biases, and
`down_proj` (E, hidden, dim) with a bias, and compute the clamped SwiGLU (`models/gpt_oss.py`).
"""

from __future__ import annotations

from meshforge.models import shapes
from meshforge.models.args import ModelArgs
from meshforge.models.layer_types import window_of
from meshforge.models.shapes import ModelShape, ModuleShape, ParamShape, linear, rms_norm


def attention(a: ModelArgs, layer: int) -> ModuleShape:
    """q, k, v, o (biases with `attention_bias`), the attention slot with this layer's window, and the sinks."""
    b = a.attention_bias
    children = {"wq": linear(a.dim, a.n_heads * a.hd, b), "wk": linear(a.dim, a.n_kv_heads * a.hd, b),
                "wv": linear(a.dim, a.n_kv_heads * a.hd, b), "wo": linear(a.n_heads * a.hd, a.dim, b),
                "core": ModuleShape("CoreAttention", init=(window_of(a, layer),)),
                "sinks": ModuleShape("AttentionSinks", {"weight": ParamShape((a.n_heads,))}, init=(a.n_heads,))}
    return ModuleShape("GptOssAttention", children=children, init=(a, layer))


def experts(n_experts: int, dim: int, hidden: int, alpha: float, limit: float) -> ModuleShape:
    """The routed experts in transformers' layout; per-expert LoRA under `adapters`."""
    e = n_experts
    return ModuleShape("GptOssExperts", {"gate_up_proj": ParamShape((e, dim, 2 * hidden)),
                                         "gate_up_proj_bias": ParamShape((e, 2 * hidden)),
                                         "down_proj": ParamShape((e, hidden, dim)),
                                         "down_proj_bias": ParamShape((e, dim))},
                       {"adapters": ModuleShape("ModuleDict")}, init=(e, dim, hidden, alpha, limit))


def moe(a: ModelArgs) -> ModuleShape:
    """Router (a gate with a bias, softmax over the top k) and the experts; no shared experts."""
    return ModuleShape("GptOssMoE", children={
        "router": shapes.router(a.dim, a.n_experts, a.top_k, a.score_func, a.route_norm, a.router_bias_update_rate,
                                bias=True),
        "experts": experts(a.n_experts, a.dim, a.moe_ffn_dim, a.swiglu_alpha, a.swiglu_limit),
        "shared_experts": None}, init=(a,))


def block(a: ModelArgs, layer: int) -> ModuleShape:
    return ModuleShape("GptOssBlock", children={"attention_norm": rms_norm(a.dim, a.norm_eps),
                                                "attention": attention(a, layer),
                                                "ffn_norm": rms_norm(a.dim, a.norm_eps), "feed_forward": moe(a)},
                       init=(a, layer))


class GptOssShape(ModelShape):
    """The GPT-OSS model's description and the contract methods the planner asks."""

    moe_kind = "GptOssMoE"

    def block(self, args: ModelArgs, layer: int) -> ModuleShape:
        return block(args, layer)

    def model_kind(self, args: ModelArgs) -> str:
        return "GptOss"

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(sequence_parallel)


def describe(args: ModelArgs) -> GptOssShape:
    """The model's description; its FLOPs, pipeline layout and LoRA layout are the MoE decoder's (the experts a
    token visits, the router and, per layer, the keys its window sees: models/shapes.py)."""
    return GptOssShape(args)


def tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """Attention split by heads as in Llama, the sinks with their heads; router and experts whole (EP splits
    the experts)."""
    return {**shapes.moe_tp_plan(sequence_parallel), "layers.*.attention.sinks": "local_heads"}
