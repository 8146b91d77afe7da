"""Hugging Face Qwen3 (`Qwen3ForCausalLM`): Llama's layers with a per-head RMSNorm on q and k before RoPE
(`q_norm`, `k_norm`), `head_dim` independent of hidden_size / heads, and optional `attention_bias`.
"""

from meshforge.models.hf_dense import DenseFamily

QWEN3 = DenseFamily("qwen3", "Qwen3ForCausalLM", fixed={"qkv_bias": False, "qk_norm": True},
                    reads_attention_bias=True, sliding="qwen", default_max_positions=32768)
