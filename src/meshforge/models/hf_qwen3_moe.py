"""Hugging Face Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (QK-norm), a softmax top-k router with
optional renormalisation (`norm_topk_prob`), experts `mlp.experts.{e}.gate_proj/up_proj/down_proj` of size
`moe_intermediate_size`. Every layer must be sparse (`decoder_sparse_step: 1`, `mlp_only_layers: []`).
"""

from meshforge.models.hf_moe import MoEFamily

QWEN3_MOE = MoEFamily("qwen3_moe", "Qwen3MoeForCausalLM", fixed={"qkv_bias": False, "qk_norm": True},
                      reads_attention_bias=True, sliding="qwen", default_max_positions=32768,
                      must_be={"decoder_sparse_step": 1, "mlp_only_layers": []})
