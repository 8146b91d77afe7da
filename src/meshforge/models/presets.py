"""Model shapes by name. Pure data (no torch), so config rules can read them before anything starts.

Published shapes: Llama 3.2 1B / Llama 3 8B / Llama 3 70B (Meta's model cards and configs),
Mixtral 8x7B, and a Qwen3-30B-A3B-like MoE (no QK-norm).
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
        if self.is_moe and not (1 <= self.top_k <= self.n_experts):
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}")
        return self


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704, max_seq_len=1024),
    "llama3_2_1b": ModelArgs(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                             max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True),
    "llama3_8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           max_seq_len=8192, rope_theta=500000.0),
    "llama3_70b": ModelArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            max_seq_len=8192, rope_theta=500000.0),
    "tiny_moe": ModelArgs(n_experts=4, top_k=2, moe_ffn_dim=64, n_shared_experts=1),
    "mixtral_8x7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                              max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, moe_ffn_dim=14336,
                              route_norm=True),
    "qwen3_30b_a3b": ModelArgs(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                               ffn_dim=6144, max_seq_len=40960, rope_theta=1e6, n_experts=128, top_k=8,
                               moe_ffn_dim=768, route_norm=True, norm_eps=1e-6),
}


def resolve_model_args(model_cfg: Any) -> ModelArgs:
    """Preset + overrides -> validated ModelArgs; unknown preset names list the known ones."""
    if model_cfg.preset not in PRESETS:
        raise KeyError(f"model.preset={model_cfg.preset!r} is not a known preset; choose one of "
                       f"{', '.join(PRESETS)}")
    known = {f.name for f in fields(ModelArgs)}
    overrides = {k: v for k, v in model_cfg.overrides().items() if k in known}
    return replace(PRESETS[model_cfg.preset], **overrides).validate()
