"""Model shapes by name. Pure data (no torch), so config rules can read them before anything starts.

Published shapes: Llama 3.2 1B/3B, Llama 3 8B/70B, Llama 3.1 8B (Meta's configs), Qwen2.5 0.5B/7B, Qwen3
0.6B/8B, Mistral 7B v0.3 (their config.json files; parameter counts checked in tests/checkpoint/test_hf_families.py),
Mixtral 8x7B and Qwen3-30B-A3B.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None
    ffn_dim: int = 176
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # mixture of experts: n_experts == 0 means a dense model
    n_experts: int = 0
    n_shared_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    aux_loss_coeff: float = 0.01
    # Hugging Face families (models/hf_*.py): the family names the HF architecture; the flags are its layers
    family: str = "llama"  # llama | qwen2 | qwen3 | mistral | mixtral | qwen3_moe: HF names and config.json
    attention_bias: bool = False  # biases on q, k, v and o projections (HF `attention_bias`)
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    rope_type: str = "default"  # default | llama3 (Llama 3.1/3.2 frequency scaling, the four keys below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    sliding_window: int | None = None  # Mistral: exact while training.seq_len <= it (a rule refuses longer)
    bos_token_id: int | None = None  # written to generation_config.json on export
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None  # HF padding_idx: that embedding row gets no gradient from the lookup
    # any transformers causal LM (models/hf_auto.py): its folder or config.json; the fields above then describe
    # its shape for rules and the planner, and build_model builds the transformers model itself
    hf_model: str | None = None

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def validate(self) -> ModelArgs:
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads} "
                             "(grouped-query attention shares each kv head among a whole number of heads)")
        if self.hd % 2:
            raise ValueError(f"head dim {self.hd} must be even for rotary embeddings")
        if self.family not in HF_FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not one of {', '.join(HF_FAMILIES)}")
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"model.rope_type={self.rope_type!r} must be default or llama3")
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor (llama3 RoPE)")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"model.pad_token_id={self.pad_token_id} is outside the vocabulary (model.vocab_size="
                             f"{self.vocab_size})")
        if self.is_moe and not (1 <= self.top_k <= self.n_experts):
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}")
        return self


HF_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
_LLAMA31_ROPE = {"rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                 "rope_original_max_seq_len": 8192}

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
    "qwen3_30b_a3b": ModelArgs(family="qwen3_moe", qk_norm=True, vocab_size=151936, dim=2048, n_layers=48,
                               n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, max_seq_len=40960,
                               rope_theta=1e6, n_experts=128, top_k=8, moe_ffn_dim=768, route_norm=True,
                               norm_eps=1e-6, aux_loss_coeff=0.001, bos_token_id=151643, eos_token_id=151645),
}


def resolve_model_args(model_cfg: Any) -> ModelArgs:
    """Preset + overrides -> validated ModelArgs; unknown preset names list the known ones."""
    if model_cfg.preset not in PRESETS:
        raise KeyError(f"model.preset={model_cfg.preset!r} is not a known preset; choose one of "
                       f"{', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelArgs)}
    overrides = {k: v for k, v in model_cfg.overrides().items() if k in known}
    return replace(PRESETS[model_cfg.preset], **overrides).validate()
