"""GPT-OSS (OpenAI's open-weight MoE, transformers' `GptOssForCausalLM`) in plain PyTorch, from its description
(models/gpt_oss_shape.py).

What differs from the Llama-style MoE (`models/moe.py`):
- attention: biases on q, k, v, o; attention sinks (`AttentionSinks`: a learned logit per head that joins every
  softmax's denominator and attends to nothing); local layers (a sliding window) alternating with global ones;
  YaRN rotary scaling (models/rope.py), the same table on every layer.
- router: a gate with a bias; softmax over the top-k gate logits (the same weights as a softmax over all experts
  renormalised over the top k, which is what `Router` computes).
- experts: transformers' layout (fused, interleaved gate/up projection and the down projection, each with a bias)
  and its clamped SwiGLU: gate = min(gate, limit), up = clamp(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshforge.models import gpt_oss_shape, shapes
from meshforge.models.args import ModelArgs
from meshforge.models.layer_types import rope_of
from meshforge.models.layered import LayeredDecoder
from meshforge.models.llama import Attention, TransformerBlock
from meshforge.models.lora import ExpertLoRA
from meshforge.models.materialize import buildable, build_children
from meshforge.models.moe import MoE, GroupedExperts, grouped_mm_supported
from meshforge.models.protocol import InitSpec


@buildable
class GptOssAttention(Attention):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.hd
        build_children(self, gpt_oss_shape.attention(args, layer))  # wq, wk, wv, wo, core, sinks


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """transformers' `GptOssExperts._apply_gate` on the interleaved (..., 2 x hidden) projection."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@buildable
class GptOssExperts(GroupedExperts):
    """The routed experts as transformers stores them; `forward(x, counts)` on rows sorted by expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int, alpha: float, limit: float):
        nn.Module.__init__(self)
        # gate_up_proj (E, dim, 2h), gate_up_proj_bias (E, 2h), down_proj (E, h, dim), down_proj_bias (E, dim)
        build_children(self, gpt_oss_shape.experts(n_experts, dim, hidden, alpha, limit))
        self.alpha, self.limit = alpha, limit
        self.grad_scale = 1.0  # expert parallelism scales the gradients (distributed/expert_parallel.py)

    def add_lora(self, role: str, rank: int, alpha: float) -> None:
        """Per-expert adapters on `experts.gate_up_proj` (its fused, interleaved columns) or `experts.down_proj`."""
        weight = self.gate_up_proj if role == "experts.gate_up_proj" else self.down_proj
        if role not in ("experts.gate_up_proj", "experts.down_proj"):
            raise ValueError(f"peft: GPT-OSS experts have no adapter role {role!r}")
        n, in_f, out_f = weight.shape
        self.adapters[role.rpartition(".")[2]] = ExpertLoRA(n, in_f, out_f, rank, alpha, like=weight)

    def _adapted_weights(self, gate_up: torch.Tensor, down: torch.Tensor):
        """The (local) weights plus their adapters' deltas (B A is (E, out, in); the weights are (E, in, out))."""
        if "gate_up_proj" in self.adapters:
            gate_up = gate_up + self.adapters["gate_up_proj"].delta(self._local).transpose(1, 2)
        if "down_proj" in self.adapters:
            down = down + self.adapters["down_proj"].delta(self._local).transpose(1, 2)
        return gate_up.contiguous(), down.contiguous()

    @torch.no_grad()
    def merge_lora(self) -> None:
        gate_up, down = self._adapted_weights(self.gate_up_proj, self.down_proj)
        self.gate_up_proj.copy_(gate_up)
        self.down_proj.copy_(down)
        self.adapters = nn.ModuleDict()

    def forward(self, x: torch.Tensor, counts: torch.Tensor, counts_list: list[int] | None = None) -> torch.Tensor:
        """x: (N, dim) rows grouped by expert in order; counts: (local experts,) rows per expert (`counts_list`:
        the same, when the host already knows them: balanced routing)."""
        w1, b1 = self._local(self.gate_up_proj), self._local(self.gate_up_proj_bias)
        w2, b2 = self._local(self.down_proj), self._local(self.down_proj_bias)
        if len(self.adapters):
            w1, w2 = self._adapted_weights(w1, w2)
        x = x.to(w1.dtype)
        if self.use_grouped_mm and grouped_mm_supported(x, w1, w2):
            expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(x.contiguous(), w1, offs=offs) + b1[expert]
            out = torch._grouped_mm(clamped_swiglu(h, self.alpha, self.limit), w2, offs=offs) + b2[expert]
            if out.requires_grad:  # _grouped_mm's backward rejects expanded (stride 0) gradients
                out.register_hook(lambda g: g.contiguous())
            return out
        # every expert runs, also on zero rows: its weights then get a zero gradient, never None
        outs = []
        for e, xe in enumerate(torch.split(x, counts.tolist() if counts_list is None else counts_list)):
            outs.append(clamped_swiglu(xe @ w1[e] + b1[e], self.alpha, self.limit) @ w2[e] + b2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


@buildable
class GptOssMoE(MoE):
    def __init__(self, args: ModelArgs):
        super().__init__(args, gpt_oss_shape.moe(args))  # router, experts, shared_experts (None)


@buildable
class GptOssBlock(TransformerBlock):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        build_children(self, gpt_oss_shape.block(args, layer))  # attention_norm, attention, ffn_norm, feed_forward
        self.rope = rope_of(args, layer)


class GptOss(LayeredDecoder):
    """GPT-OSS: returns (logits, aux loss) in training, like `MoETransformer`."""

    description = staticmethod(gpt_oss_shape.describe)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return gpt_oss_shape.tp_plan(sequence_parallel)

    def init_spec(self, name: str) -> InitSpec:
        if name.endswith(("_bias", ".bias")):
            return InitSpec("zeros")
        if name.endswith("experts.down_proj"):  # the residual projection of the experts
            return InitSpec("normal", self.args.init_std / math.sqrt(2 * self.args.n_layers))
        return super().init_spec(name)

    def active_ffn_params_per_layer(self) -> int:
        return shapes.active_ffn_params_per_layer(self.args)


def model_class(args: ModelArgs) -> type[GptOss]:
    return GptOss
