"""Hugging Face LlamaForCausalLM <-> meshforge `Llama`: tensor names, the q/k row permutation, config.json.

meshforge's RoPE rotates interleaved pairs (Meta's layout) while HF Llama rotates halves (`rotate_half`), so
the rows of wq/wk are permuted within each head on export and back on import, exactly as HF's
`convert_llama_weights_to_hf.py` does:
`permute(w, n_heads) = w.view(n_heads, hd/2, 2, dim).transpose(1, 2).reshape(n_heads*hd, dim)`.
"""

from __future__ import annotations

import re

import torch

from meshforge.errors import CheckpointError
from meshforge.models.presets import ModelArgs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# meshforge name -> HF name; `{}` is the layer index
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(ours).replace(r"\{\}", r"(\d+)") + "$"), theirs)
             for ours, theirs in _NAMES.items()]


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows (Meta) -> rotate_half rows (HF), per head."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_to_hf`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaStateDictAdapter:
    def __init__(self, args: ModelArgs):
        self.args = args

    def hf_names(self, name: str) -> list[str]:
        if name == "output.weight" and self.args.tie_embeddings:
            return []  # the head shares the embedding's tensor; HF ties it back from config.json
        for pattern, theirs in _PATTERNS:
            m = pattern.match(name)
            if m:
                return [theirs.format(*m.groups())]
        raise KeyError(f"parameter {name} has no Hugging Face Llama name")

    def _heads(self, name: str) -> int | None:
        if name.endswith("attention.wq.weight"):
            return self.args.n_heads
        if name.endswith("attention.wk.weight"):
            return self.args.n_kv_heads
        return None

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        heads = self._heads(name)
        return {theirs: (permute_to_hf(tensor, heads) if heads else tensor).contiguous()
                for theirs in self.hf_names(name)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (t,) = tensors.values()
        heads = self._heads(name)
        return permute_from_hf(t, heads) if heads else t

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict:
        a = self.args
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
                "hidden_size": a.dim, "intermediate_size": a.ffn_dim, "num_hidden_layers": a.n_layers,
                "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.hd,
                "max_position_embeddings": a.max_seq_len, "rope_theta": a.rope_theta, "rms_norm_eps": a.norm_eps,
                "tie_word_embeddings": bool(a.tie_embeddings), "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "initializer_range": a.init_std, "torch_dtype": _DTYPE_NAMES.get(dtype, "float32")}


def args_from_hf_config(c: dict) -> dict:
    """HF config.json -> meshforge `model.*` values (on top of any preset)."""
    if c.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json: model_type={c.get('model_type')!r} is not supported (llama only)")
    out = {"vocab_size": c["vocab_size"], "dim": c["hidden_size"], "ffn_dim": c["intermediate_size"],
           "n_layers": c["num_hidden_layers"], "n_heads": c["num_attention_heads"],
           "n_kv_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
           "max_seq_len": c.get("max_position_embeddings", 2048), "rope_theta": float(c.get("rope_theta", 10000.0)),
           "norm_eps": float(c.get("rms_norm_eps", 1e-5)), "tie_embeddings": bool(c.get("tie_word_embeddings"))}
    hd = c.get("head_dim")
    if hd and hd != c["hidden_size"] // c["num_attention_heads"]:
        out["head_dim"] = hd
    return out
