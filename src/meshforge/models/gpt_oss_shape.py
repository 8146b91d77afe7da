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
from meshforge.models.layer_types import attention_forward_flops_per_token, window_of
from meshforge.models.protocol import AdapterLayout
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
        "router": shapes.router(a.dim, a.n_experts, a.top_k, a.score_func, a.route_norm, bias=True),
        "experts": experts(a.n_experts, a.dim, a.moe_ffn_dim, a.swiglu_alpha, a.swiglu_limit),
        "shared_experts": None}, init=(a,))


def block(a: ModelArgs, layer: int) -> ModuleShape:
    return ModuleShape("GptOssBlock", children={"attention_norm": rms_norm(a.dim, a.norm_eps),
                                                "attention": attention(a, layer),
                                                "ffn_norm": rms_norm(a.dim, a.norm_eps), "feed_forward": moe(a)},
                       init=(a, layer))


class GptOssShape(ModelShape):
    """The GPT-OSS model's description and the contract methods the planner asks."""

    def block(self, args: ModelArgs, layer: int) -> ModuleShape:
        return block(args, layer)

    def model_kind(self, args: ModelArgs) -> str:
        return "GptOss"

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(sequence_parallel)

    def moe_layers(self) -> list[ModuleShape]:
        return [m for _, m in self.named_modules() if m.kind == "GptOssMoE"]

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.args, seq_len)

    def attention_forward_flops_per_token(self, seq_len: int) -> float:
        return attention_forward_flops_per_token(self.args, seq_len)

    def adapter_layout(self) -> AdapterLayout:
        return adapter_layout(self.args)


def describe(args: ModelArgs) -> GptOssShape:
    return GptOssShape(args)


def tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """Attention split by heads as in Llama, the sinks with their heads; router and experts whole (EP splits
    the experts)."""
    return {**shapes.moe_tp_plan(sequence_parallel), "layers.*.attention.sinks": "heads"}


def active_ffn_params_per_layer(a: ModelArgs) -> int:
    """The top_k experts a token visits (gate, up, down) and the router."""
    return 3 * a.dim * a.moe_ffn_dim * a.top_k + a.dim * a.n_experts


def flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """6 x the matmul parameters a token multiplies by (attention projections, its experts, router, output head)
    plus 3 x the attention forward, each layer over its own window (biases and sinks are negligible)."""
    attn_proj = a.dim * a.hd * (2 * a.n_heads + 2 * a.n_kv_heads)
    matmul = a.n_layers * (attn_proj + active_ffn_params_per_layer(a)) + a.dim * a.vocab_size
    return 6 * matmul + 3 * attention_forward_flops_per_token(a, seq_len)


def adapter_layout(a: ModelArgs) -> AdapterLayout:
    """Attention projections by their HF names, the experts' two fused weights as grouped roles (PEFT's
    `target_parameters`); the router and the sinks are not adapted."""
    dense = shapes.adapter_layout(a)
    experts = "layers.*.feed_forward.experts"
    return AdapterLayout(linears={k: v for k, v in dense.linears.items() if ".feed_forward." not in v},
                         embeddings=dense.embeddings, norms=dense.norms,
                         experts={"experts.gate_up_proj": experts, "experts.down_proj": experts})
