"""Hugging Face Llama 3 / 3.1 / 3.2 (`LlamaForCausalLM`): optional `attention_bias` (q, k, v, o),
`mlp_bias` (refused when true), `head_dim`, and llama3 RoPE scaling (read by `hf_dense`).
"""

from meshforge.models.hf_dense import DenseFamily, permute_from_hf, permute_to_hf

__all__ = ["LLAMA", "permute_from_hf", "permute_to_hf"]

LLAMA = DenseFamily("llama", "LlamaForCausalLM", fixed={"qkv_bias": False, "qk_norm": False},
                    reads_attention_bias=True, reads_mlp_bias=True, reads_pretraining_tp=True)
