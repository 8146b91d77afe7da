"""Model shapes by name (`ModelArgs`, declared in models/args.py). Pure data (no torch), so config rules can read
them before anything starts.

Published shapes: Llama 3.2 1B/3B, Llama 3 8B/70B, Llama 3.1 8B (Meta's configs), Qwen2.5 0.5B/7B, Qwen3
0.6B/8B, Mistral 7B v0.3 (their config.json files; parameter counts checked in tests/checkpoint/test_hf_families.py),
Mixtral 8x7B, Qwen3-30B-A3B, DeepSeek-V3, GPT-OSS 20B/120B (bf16) and Gemma 3 1B; `tiny_gpt_oss` and
`tiny_gemma3` turn every option of those families on at the tiny shape (windows shorter than the tests' sequences).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshforge.models.args import ModelArgs, model_fields

_LLAMA31_ROPE = {"rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                 "rope_original_max_seq_len": 8192}

_GPT_OSS = dict(family="gpt_oss", vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
                ffn_dim=2880, moe_ffn_dim=2880, n_experts=32, top_k=4, route_norm=True, attention_bias=True,
                max_seq_len=131072, rope_theta=150000.0, rope_type="yarn", rope_factor=32.0,
                rope_original_max_seq_len=4096, yarn_truncate=False, sliding_window=128, sliding_window_pattern=2,
                norm_eps=1e-5, aux_loss_coeff=0.9, eos_token_id=200002, pad_token_id=199999)

PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, max_seq_len=1024),
    "llama3_2_1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True, norm_eps=1e-5,
                             **{**_LLAMA31_ROPE, "rope_factor": 32.0}, bos_token_id=128000, eos_token_id=128001),
    "llama3_2_3b": ModelArgs(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
                             max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True,
                             **{**_LLAMA31_ROPE, "rope_factor": 32.0}, bos_token_id=128000, eos_token_id=128001),
    "llama3_1_8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             max_seq_len=131072, rope_theta=500000.0, **_LLAMA31_ROPE, bos_token_id=128000,
                             eos_token_id=128001),
    "llama3_8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           max_seq_len=8192, rope_theta=500000.0),
    "llama3_70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            max_seq_len=8192, rope_theta=500000.0),
    "qwen2_5_7b": ModelArgs(family="qwen2", qkv_bias=True, vocab_size=152064, dim=3584, n_layers=28, n_heads=28,
                            n_kv_heads=4, ffn_dim=18944, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6,
                            bos_token_id=151643, eos_token_id=151643),
    "qwen2_5_0_5b": ModelArgs(family="qwen2", qkv_bias=True, vocab_size=151936, dim=896, n_layers=24, n_heads=14,
                              n_kv_heads=2, ffn_dim=4864, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6,
                              tie_embeddings=True, bos_token_id=151643, eos_token_id=151643),
    "qwen3_8b": ModelArgs(family="qwen3", qk_norm=True, vocab_size=151936, dim=4096, n_layers=36, n_heads=32,
                          n_kv_heads=8, head_dim=128, ffn_dim=12288, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                          bos_token_id=151643, eos_token_id=151645),
    "qwen3_0_6b": ModelArgs(family="qwen3", qk_norm=True, vocab_size=151936, dim=1024, n_layers=28, n_heads=16,
                            n_kv_heads=8, head_dim=128, ffn_dim=3072, max_seq_len=40960, rope_theta=1e6,
                            norm_eps=1e-6, tie_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "mistral_7b": ModelArgs(family="mistral", vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, bos_token_id=1, eos_token_id=2),
    "tiny_moe": ModelArgs(n_experts=4, top_k=2, moe_ffn_dim=64, n_shared_experts=1),
    "mixtral_8x7b": ModelArgs(family="mixtral", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                              ffn_dim=14336, max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2,
                              moe_ffn_dim=14336, route_norm=True, aux_loss_coeff=0.02, bos_token_id=1,
                              eos_token_id=2),
    # GPT-OSS (OpenAI, transformers' GptOssForCausalLM): config.json of gpt-oss-20b / gpt-oss-120b, bf16 weights
    "gpt_oss_20b": ModelArgs(**_GPT_OSS),
    "gpt_oss_120b": ModelArgs(**{**_GPT_OSS, "n_layers": 36, "n_experts": 128}),
    # Gemma 3 1B (google/gemma-3-1b-pt, Gemma3ForCausalLM)
    "gemma3_1b": ModelArgs(family="gemma3_text", qk_norm=True, vocab_size=262144, dim=1152, n_layers=26, n_heads=4,
                           n_kv_heads=1, head_dim=256, ffn_dim=6912, max_seq_len=32768, rope_theta=1e6,
                           rope_local_theta=10000.0, sliding_window=512, sliding_window_pattern=6,
                           query_pre_attn_scalar=256, norm_eps=1e-6, tie_embeddings=True, bos_token_id=2,
                           eos_token_id=1, pad_token_id=0),
    # tiny versions with every option on, windows shorter than the tests' sequences (32)
    "tiny_gpt_oss": ModelArgs(family="gpt_oss", n_experts=4, top_k=2, moe_ffn_dim=64, ffn_dim=64, attention_bias=True,
                              sliding_window=16, sliding_window_pattern=2, rope_theta=150000.0, rope_type="yarn",
                              rope_factor=4.0, rope_original_max_seq_len=64, yarn_truncate=False),
    "tiny_gemma3": ModelArgs(family="gemma3_text", qk_norm=True, sliding_window=16, sliding_window_pattern=2,
                             rope_theta=1e6, rope_local_theta=10000.0, rope_type="linear", rope_factor=2.0,
                             query_pre_attn_scalar=24, final_logit_softcap=30.0, tie_embeddings=True,
                             norm_eps=1e-6),
    "qwen3_30b_a3b": ModelArgs(family="qwen3_moe", qk_norm=True, vocab_size=151936, dim=2048, n_layers=48,
                               n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, max_seq_len=40960,
                               rope_theta=1e6, n_experts=128, top_k=8, moe_ffn_dim=768, route_norm=True,
                               norm_eps=1e-6, aux_loss_coeff=0.001, bos_token_id=151643, eos_token_id=151645),
    # DeepSeek-V3 (671B without its multi-token prediction module; the paper's bias update speed 0.001)
    "deepseek_v3": ModelArgs(family="deepseek_v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128,
                             n_kv_heads=128, head_dim=192, ffn_dim=18432, max_seq_len=163840, norm_eps=1e-6,
                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, first_k_dense=3, n_experts=256, top_k=8, moe_ffn_dim=2048,
                             n_shared_experts=1, score_func="sigmoid", route_norm=True, aux_loss_coeff=0.0,
                             router_bias_update_rate=0.001, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                             rope_type="yarn", rope_factor=40.0, rope_original_max_seq_len=4096, yarn_mscale=1.0,
                             yarn_mscale_all_dim=1.0, bos_token_id=0, eos_token_id=1),
    # its shape in small: one dense block then one MoE block, compressed q and kv, group-limited routing
    "tiny_deepseek": ModelArgs(family="deepseek_v3", n_heads=4, n_kv_heads=4, head_dim=24, q_lora_rank=32,
                               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                               first_k_dense=1, n_experts=8, top_k=2, moe_ffn_dim=32, n_shared_experts=1,
                               score_func="sigmoid", aux_loss_coeff=0.0, n_group=4, topk_group=2,
                               routed_scaling_factor=2.5),
}


def resolve_model_args(model_cfg: Any) -> ModelArgs:
    """Preset + overrides -> validated ModelArgs; unknown preset names list the known ones."""
    if model_cfg.preset not in PRESETS:
        raise KeyError(f"model.preset={model_cfg.preset!r} is not a known preset; choose one of "
                       f"{', '.join(PRESETS)}")
    known = {a.name for a in model_fields()}
    overrides = {k: v for k, v in model_cfg.overrides().items() if k in known}
    return replace(PRESETS[model_cfg.preset], **overrides).validate()
