"""DeepSeek-V3 in plain PyTorch: multi-head latent attention, YaRN RoPE, dense-then-MoE blocks with shared experts
and a sigmoid, group-limited router whose selection bias balances the load without an auxiliary loss.

Structure and names are described in models/deepseek_v3_shapes.py (the planner reads that); this file says how the
modules compute, against transformers' `modeling_deepseek_v3.py` (tests/checkpoint/test_hf_deepseek_v3.py compares
logits and greedy tokens). The model keeps the model contract exactly as `Llama` does (it is one): blocks, TP plan,
pipeline layout (dense and MoE blocks alike are split points), attention slots, init by name, FLOPs, HF adapter;
forward takes packed sequences' document ids and, in training with an auxiliary loss, returns (logits, aux).

How the parallelisms meet the latent attention:
- TP splits heads: `wq` / `wq_b` and `wkv_b` column-wise, `wo` row-wise; the compressions (`wq_a`, `wkv_a`) and
  their norms are whole on every rank (their outputs' gradients arrive complete through the column-wise layers'
  input reduction). The rope half of the key is one head every query head shares: each rank's heads add only
  their part of its gradient, so `k_rope` (a `SharedKey`, identity forward) is declared `shared_input` and tensor
  parallelism sums that gradient over the ranks.
- CP gathers the expanded K/V per chunk (the attention slot's contract: the slot sees (q, k, v) per head).
  Gathering the latent instead (kv_lora_rank + qk_rope_head_dim values a token, 576 for DeepSeek-V3 against
  128 x (192 + 128) expanded) would move ~70x fewer bytes but re-expand the whole sequence through `wkv_b` on every
  cp rank; not done yet.
- EP shards the routed experts (the MoE layers are the contract's `moe_layers`); the selection bias is a buffer,
  replicated, updated identically on every rank from the globally summed load.
- The softmax scale qk_head_dim^-1/2 * mscale^2 (YaRN's `mscale_all_dim`) is folded into q before the slot, so the
  slot (and its CP replacement) keeps its default scale.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshforge.models import deepseek_v3_shapes as ds
from meshforge.models import rope
from meshforge.models.args import ModelArgs
from meshforge.models.hf_families import dense_adapter
from meshforge.models.kv_cache import KVCache, LayerCache
from meshforge.models.layer_types import global_rope
from meshforge.models.llama import Llama, TransformerBlock, apply_rope, block_forward, cache_mask
from meshforge.models.materialize import build_children, buildable
from meshforge.models.moe import MoE, Router, take_aux_loss, with_aux_loss
from meshforge.models.protocol import AdapterLayout, InitSpec, StateDictAdapter


def mla_rope(positions: torch.Tensor, args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (..., S, qk_rope_head_dim/2) of the rotary half, for true positions (models/rope.py: YaRN scales
    both by its attention factor)."""
    return rope.tables(positions, args.qk_rope_head_dim, global_rope(args))


def apply_rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, S, H, D) rotating the halves (x_i, x_{i+D/2}) together: transformers' `rotate_half`."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def softmax_scale_factor(args: ModelArgs) -> float:
    """What the attention's default 1/sqrt(qk_head_dim) is multiplied by: YaRN's mscale(factor, mscale_all_dim)^2
    (transformers' `yarn_apply_mscale`), else 1."""
    if args.rope_type == "yarn" and args.yarn_mscale_all_dim:
        return rope.get_mscale(args.rope_factor, args.yarn_mscale_all_dim) ** 2
    return 1.0


@buildable
class SharedKey(nn.Module):
    """The rope half of the key, one head every query head shares: identity. Declared in the TP plan so that tensor
    parallelism sums its gradient over the ranks' heads (module docstring)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, k_rot: torch.Tensor) -> torch.Tensor:
        return k_rot


@buildable
class MLA(nn.Module):
    """Multi-head latent attention (models/deepseek_v3_shapes.py `mla`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.q_scale = softmax_scale_factor(args)
        self.rotate = apply_rope if args.rope_interleave else apply_rope_halves
        build_children(self, ds.mla(args))  # wq | wq_a, q_norm, wq_b; wkv_a, kv_norm, wkv_b, wo, k_rope, core

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                cache: LayerCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x) if "wq" in self._modules else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 instead of n_heads: under tensor parallelism each rank holds a slice of the heads
        q = q.view(b, s, -1, self.nope + self.rope)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_rot = self.wkv_a(x).split([self.args.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_c)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = self.rotate(q_rot, cos, sin)
        k_rot = self.k_rope(self.rotate(k_rot.unsqueeze(2), cos, sin))
        q = torch.cat([q_nope, q_rot], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:  # the expanded keys/values (models/kv_cache.py); caching the latent would be smaller
            k, v = cache.append(k, v)
        out = self.core(q, k, v) if mask is None else self.core(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


@buildable
class GroupLimitedRouter(Router):
    """Sigmoid scores; the experts of the `topk_group` best of `n_group` groups (a group scores its two best
    experts, selection bias included) compete for the top k; weights are the unbiased scores (renormalised with
    `route_norm`) times `routed_scaling_factor`. The selection bias is always kept (`e_score_correction_bias`);
    `router_bias_update_rate` > 0 also updates it (Router)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args.dim, args.n_experts, args.top_k, "sigmoid", args.route_norm,
                         args.router_bias_update_rate)
        if not self.has_bias:
            self.register_buffer("expert_bias", torch.zeros(args.n_experts, dtype=torch.float32))
        self.n_group, self.topk_group, self.scale = args.n_group, args.topk_group, args.routed_scaling_factor

    def _select(self, choice: torch.Tensor) -> torch.Tensor:
        if self.n_group > 1:
            groups = choice.view(choice.shape[0], self.n_group, -1)
            best = groups.topk(2, dim=-1).values.sum(-1)  # (T, n_group)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1).indices,
                                                                     True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        return choice.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores, idx, weights = super().forward(x)
        return scores, idx, weights * self.scale if self.scale != 1.0 else weights


@buildable
class DeepSeekMoE(MoE):
    """`MoE` (router, routed experts, shared experts) with the group-limited router."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, ds.moe(args))


@buildable
class MLABlock(TransformerBlock):
    """Pre-norm latent attention, then a pre-norm dense SwiGLU or DeepSeek MoE (`TransformerBlock`'s forward)."""

    def __init__(self, args: ModelArgs, sparse: bool):
        nn.Module.__init__(self)
        build_children(self, ds.block(args, sparse))  # attention_norm, attention, ffn_norm, feed_forward


class DeepSeekV3(Llama):
    """The model (module docstring); forward returns (logits, aux_loss) in training with model.aux_loss_coeff > 0."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        build_children(self, ds.describe(args))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None):
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = mla_rope(positions, self.args)
        mask = cache_mask(cache, tokens, document_ids)
        in_document = None if document_ids is None else document_ids >= 0  # padding: out of router statistics
        aux = None
        for i, block in enumerate(self.layers.values()):
            h = block_forward(block, h, cos, sin, mask, cache, i,
                              in_document if isinstance(block.feed_forward, MoE) else None)
            aux = take_aux_loss(block.feed_forward, aux)
        if self.norm is not None:
            h = self.norm(h)
        return with_aux_loss(self, self.head(h), aux)

    # ------------------------------------------------------------ declared plans
    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return ds.tp_plan(self.args, sequence_parallel)  # declared in the description, which the planner reads

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def init_spec(self, name: str) -> InitSpec:
        """Normal(init_std) weights (residual projections / sqrt(2 n_layers)), ones for norms, zeros for biases (the
        router's selection bias, a buffer, starts at zero: `Router._apply`)."""
        if name.endswith(("norm.weight", ".bias")):
            return InitSpec("ones" if name.endswith("norm.weight") else "zeros")
        std = self.args.init_std
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            std = std / math.sqrt(2 * self.args.n_layers)
        return InitSpec("normal", std)

    def flops_per_token(self, seq_len: int) -> float:
        return ds.flops_per_token(self.args, seq_len)

    def state_dict_adapter(self) -> StateDictAdapter:
        return dense_adapter(self.args)

    def adapter_layout(self) -> AdapterLayout:
        return ds.adapter_layout(self.args)


def model_class(args: ModelArgs) -> type[DeepSeekV3]:
    """What `model.family: deepseek_v3` builds (models/family.py `Family.model`)."""
    return DeepSeekV3
