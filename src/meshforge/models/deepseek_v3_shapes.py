"""DeepSeek-V3 (models/deepseek_v3.py) described without torch, as models/shapes.py describes the Llama-style
decoder: module names, parameter shapes, the TP plan, the FLOPs, the LoRA layout. The planner reads these;
the modules build themselves from them (models/materialize.py).

The model: embeddings, `first_k_dense` dense blocks then MoE blocks (each an `MLABlock`: RMSNorm, multi-head
latent attention, RMSNorm, SwiGLU or `DeepSeekMoE`), final norm, head. Two block shapes, so `stand_ins` says
which layers share a shape: the planner describes one block of each and lets it stand for its layers.

Multi-head latent attention (`MLA`), per token: the query through a low-rank bottleneck `wq_a` -> `q_norm` ->
`wq_b` (or one `wq` when `q_lora_rank` is 0), `n_heads` x (qk_nope_head_dim + qk_rope_head_dim); keys and
values from one compressed latent `wkv_a` (kv_lora_rank, plus one qk_rope_head_dim key every head shares) ->
`kv_norm` -> `wkv_b` (n_heads x (qk_nope_head_dim + v_head_dim)); output `wo` from n_heads x v_head_dim. The
two small norms use eps 1e-6 whatever `norm_eps` is (transformers builds them with its RMSNorm default).
"""

from __future__ import annotations

import dataclasses

from meshforge.models.args import ModelArgs
from meshforge.models.protocol import AdapterLayout
from meshforge.models.shapes import ModelShape, ModuleShape, feed_forward, grouped_experts, linear, rms_norm

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep


def qk_head_dim(a: ModelArgs) -> int:
    return a.qk_nope_head_dim + a.qk_rope_head_dim


def mla(a: ModelArgs) -> ModuleShape:
    """Multi-head latent attention: see the module docstring. `k_rope` is the key every head shares (its tensor
    parallel style sums its gradient over the heads' ranks; its `init`, the width, tells the planner the bytes);
    `core` the attention slot."""
    h, qk = a.n_heads, qk_head_dim(a)
    if not a.q_lora_rank:
        children = {"wq": linear(a.dim, h * qk)}
    else:
        children = {"wq_a": linear(a.dim, a.q_lora_rank, a.attention_bias),
                    "q_norm": rms_norm(a.q_lora_rank, LATENT_NORM_EPS), "wq_b": linear(a.q_lora_rank, h * qk)}
    children.update(wkv_a=linear(a.dim, a.kv_lora_rank + a.qk_rope_head_dim, a.attention_bias),
                    kv_norm=rms_norm(a.kv_lora_rank, LATENT_NORM_EPS),
                    wkv_b=linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim)),
                    wo=linear(h * a.v_head_dim, a.dim, a.attention_bias),
                    k_rope=ModuleShape("SharedKey", init=(a.qk_rope_head_dim,)), core=ModuleShape("CoreAttention"))
    return ModuleShape("MLA", children=children, init=(a,))


def router(a: ModelArgs) -> ModuleShape:
    """Sigmoid scores, top-k within the `topk_group` best of `n_group` expert groups, selected on scores plus the
    load-balancing bias (a buffer, `expert_bias`), weights scaled by `routed_scaling_factor`."""
    return ModuleShape("GroupLimitedRouter", children={"gate": linear(a.dim, a.n_experts)}, init=(a,))


def moe(a: ModelArgs) -> ModuleShape:
    shared = feed_forward(a.dim, a.moe_ffn_dim * a.n_shared_experts) if a.n_shared_experts > 0 else None
    return ModuleShape("DeepSeekMoE", children={"router": router(a),
                                                "experts": grouped_experts(a.n_experts, a.dim, a.moe_ffn_dim),
                                                "shared_experts": shared}, init=(a,))


def block(a: ModelArgs, sparse: bool) -> ModuleShape:
    """Pre-norm latent attention, then a pre-norm SwiGLU (dense layers) or DeepSeek MoE (the others)."""
    ff = moe(a) if sparse else feed_forward(a.dim, a.ffn_dim)
    return ModuleShape("MLABlock", children={"attention_norm": rms_norm(a.dim, a.norm_eps), "attention": mla(a),
                                             "ffn_norm": rms_norm(a.dim, a.norm_eps), "feed_forward": ff},
                       init=(a, sparse))


def is_sparse(a: ModelArgs, layer: int) -> bool:
    return a.n_experts > 0 and layer >= a.first_k_dense


class DeepSeekV3Shape(ModelShape):
    """The whole model's description; the contract methods as the model answers them."""

    moe_kind = "DeepSeekMoE"

    def block(self, args: ModelArgs, layer: int) -> ModuleShape:
        return block(args, is_sparse(args, layer))

    def model_kind(self, args: ModelArgs) -> str:
        return "DeepSeekV3"

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(self.args, sequence_parallel)

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.args, seq_len)

    def adapter_layout(self) -> AdapterLayout:
        return adapter_layout(self.args)


def describe(args: ModelArgs) -> DeepSeekV3Shape:
    return DeepSeekV3Shape(args)


def stand_ins(args: ModelArgs) -> tuple[ModelArgs, tuple[int, ...]]:
    """(a model with one layer of each block shape, which of its layers stands for each of `args`' layers)."""
    k, n = args.first_k_dense, args.n_layers
    if args.n_experts == 0 or k >= n:  # dense only
        return dataclasses.replace(args, n_layers=1, first_k_dense=1), (0,) * n
    if k == 0:  # MoE only
        return dataclasses.replace(args, n_layers=1), (0,) * n
    return dataclasses.replace(args, n_layers=2, first_k_dense=1), (0,) * k + (1,) * (n - k)


def tp_plan(a: ModelArgs, sequence_parallel: bool = False) -> dict[str, str]:
    """Heads split: the query's last projection and `wkv_b` column-wise, `wo` row-wise; the compressions
    (`wq_a`, `wkv_a`) and their norms whole on every rank; the shared rope key's gradient summed over the ranks'
    heads (`shared_input`); dense MLPs and shared experts as Llama's MLP; router and routed experts whole (EP
    splits those)."""
    q = "layers.*.attention.wq_b" if a.q_lora_rank else "layers.*.attention.wq"
    plan = {"tok_embeddings": "vocab_embedding", q: "colwise", "layers.*.attention.wkv_b": "colwise",
            "layers.*.attention.k_rope": "shared_input", "layers.*.attention.wo": "rowwise"}
    if any(not is_sparse(a, i) for i in range(a.n_layers)):
        plan.update({"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
                     "layers.*.feed_forward.w2": "rowwise"})
    if a.n_shared_experts and any(is_sparse(a, i) for i in range(a.n_layers)):
        plan.update({"layers.*.feed_forward.shared_experts.w1": "colwise",
                     "layers.*.feed_forward.shared_experts.w3": "colwise",
                     "layers.*.feed_forward.shared_experts.w2": "rowwise_full" if sequence_parallel else "rowwise"})
    plan["output"] = "vocab_output"
    if sequence_parallel:
        plan.update({"layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel",
                     "norm": "sequence_parallel", "layers.*.attention": "sequence_gather",
                     "layers.*.feed_forward": "sequence_gather"})
        # an MoE gathers the sequence in and re-shards its output, as models/shapes.py's `moe_tp_plan` (its shared
        # experts' row-wise projection returns the whole sequence, to which the routed output is added)
        plan.update({f"layers.{i}.feed_forward": "sequence_gather_scatter" for i in range(a.n_layers)
                     if is_sparse(a, i)})
    return plan


def attention_params(a: ModelArgs) -> int:
    """Matmul parameters of one latent attention (every token multiplies by all of them)."""
    h, qk = a.n_heads, qk_head_dim(a)
    q = a.dim * a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else a.dim * h * qk
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + h * a.v_head_dim * a.dim


def ffn_params(a: ModelArgs, layer: int) -> int:
    """Matmul parameters a token multiplies by in a layer's MLP: the dense SwiGLU, or top_k routed experts, the
    shared experts and the router."""
    if not is_sparse(a, layer):
        return 3 * a.dim * a.ffn_dim
    return 3 * a.dim * a.moe_ffn_dim * (a.top_k + a.n_shared_experts) + a.dim * a.n_experts


def flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters a token uses, plus causal attention, 3 x (per layer and
    head) S x (qk_head_dim + v_head_dim): the scores and the weighted sum, halved for the causal mask."""
    matmul = sum(attention_params(a) + ffn_params(a, i) for i in range(a.n_layers)) + a.dim * a.vocab_size
    attention = a.n_layers * a.n_heads * seq_len * (qk_head_dim(a) + a.v_head_dim)
    return 6 * matmul + 3 * attention


def adapter_layout(a: ModelArgs) -> AdapterLayout:
    """LoRA roles by transformers' module names: the latent attention's projections, the dense layers' MLP, the
    shared experts, the routed experts (per-expert adapters); the router is not adapted."""
    att = "layers.*.attention."
    linears = ({"q_a_proj": att + "wq_a", "q_b_proj": att + "wq_b"} if a.q_lora_rank else
               {"q_proj": att + "wq"})
    linears.update({"kv_a_proj_with_mqa": att + "wkv_a", "kv_b_proj": att + "wkv_b", "o_proj": att + "wo"})
    sparse = [is_sparse(a, i) for i in range(a.n_layers)]
    if not all(sparse):
        linears.update({"gate_proj": "layers.*.feed_forward.w1", "up_proj": "layers.*.feed_forward.w3",
                        "down_proj": "layers.*.feed_forward.w2"})
    experts = {}
    if any(sparse):
        if a.n_shared_experts:
            linears.update({"shared_experts.gate_proj": "layers.*.feed_forward.shared_experts.w1",
                            "shared_experts.up_proj": "layers.*.feed_forward.shared_experts.w3",
                            "shared_experts.down_proj": "layers.*.feed_forward.shared_experts.w2"})
        experts = {"experts.gate_up_proj": "layers.*.feed_forward.experts",
                   "experts.down_proj": "layers.*.feed_forward.experts"}
    norms = ("layers.*.attention_norm", "layers.*.ffn_norm", "norm", att + "kv_norm") + \
        ((att + "q_norm",) if a.q_lora_rank else ())
    return AdapterLayout(linears=linears, embeddings=("tok_embeddings", "output"), norms=norms, experts=experts)
