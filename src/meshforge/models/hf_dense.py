"""Hugging Face dense decoders <-> meshforge `Llama`: tensor names, the q/k row permutation, config.json.

The dense families (`hf_llama.py`, `hf_qwen2.py`, `hf_qwen3.py`, `hf_mistral.py`; registered in
`hf_families.py`) share HF's tensor names and differ in config.json keys and a few layers (q/k/v biases,
q/k norms); each declares a `DenseFamily`, and this module reads and writes config.json for all of them.
Every key of a config.json is honoured or refused with one line naming it: a silently ignored key is a
silently wrong model.

Torch-free at import (the registry, and with it the config schema, reads the families before torch is
loaded): the adapter works on the tensors it is given.

meshforge's RoPE rotates interleaved pairs (Meta's layout) while HF rotates halves (`rotate_half`), so
the rows of wq/wk (and their biases and the q/k norm weights, which live in the same per-head row order)
are permuted within each head on export and back on import, as HF's `convert_llama_weights_to_hf.py` does:
`permute(w, n_heads) = w.view(n_heads, hd/2, 2, dim).transpose(1, 2).reshape(n_heads*hd, dim)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError
from meshforge.models.family import Family, registered

if TYPE_CHECKING:
    import torch

    from meshforge.models.args import ModelArgs

# config.json's `dtype` for a torch dtype (by its name, so this module need not import torch)
_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

# meshforge name -> HF name; `{}` is the layer index
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.attention.wq.bias": "model.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attention.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attention.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attention.wo.bias": "model.layers.{}.self_attn.o_proj.bias",
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def name_patterns(names: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """{meshforge name with `{}` for the layer: HF name} -> (regex, HF format) pairs, as adapters match them."""
    return [(re.compile("^" + re.escape(ours).replace(r"\{\}", r"(\d+)") + "$"), theirs)
            for ours, theirs in names.items()]


_PATTERNS = name_patterns(_NAMES)


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved-pair rows (Meta) -> rotate_half rows (HF), per head; 1-D tensors (biases) by row."""
    if w.dim() == 1:
        return permute_to_hf(w.unsqueeze(-1), n_heads).squeeze(-1)
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_to_hf`."""
    if w.dim() == 1:
        return permute_from_hf(w.unsqueeze(-1), n_heads).squeeze(-1)
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ------------------------------------------------------------------------------------ families
# config.json keys with no effect on the weights or the logits (storage dtype: tensors are cast to the run's)
_METADATA_KEYS = {"transformers_version", "torch_dtype", "dtype", "use_cache", "_name_or_path"}
# `model.rope_type`s: default and llama3 (their config.json keys below, computed by models/rope.py) for every
# family; linear and yarn for the families that name them in `Family.rope_types` (models/rope.py computes those)
ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class DenseFamily(Family):
    """What distinguishes one HF dense decoder family: names, fixed layer flags, and its own config keys."""

    fixed: dict = field(default_factory=dict)  # ModelArgs flags the family hard-codes (e.g. Qwen2's qkv bias)
    reads_attention_bias: bool = False  # config.json has `attention_bias` (q, k, v, o biases)
    reads_mlp_bias: bool = False  # config.json has `mlp_bias` (must be false: the MLP has no biases)
    reads_pretraining_tp: bool = False  # Llama's `pretraining_tp`: a matmul split with identical results
    # none | mistral (`sliding_window` on every layer) | qwen (`use_sliding_window`, ...) | layers (`layer_types`,
    # read by the family itself: Gemma 3, GPT-OSS)
    sliding: str = "none"
    default_max_positions: int = 2048

    def check_args(self, a: ModelArgs) -> None:
        """Refuse a model this family cannot express (export would write a config that drops a layer)."""
        if a.is_moe and not self.has_experts:
            moe_families = [f.name for f in registered().values() if f.has_experts]
            raise CheckpointError(f"model.family={self.name} is dense but the model has experts: use "
                                  f"model.family={' or '.join(moe_families)}")
        for flag, value in self.fixed.items():
            if getattr(a, flag) != value:
                raise CheckpointError(f"model.{flag}={getattr(a, flag)} cannot be exported as Hugging Face "
                                      f"{self.name} (it has {flag}={value}); choose another model.family")
        if a.attention_bias and not self.reads_attention_bias:
            raise CheckpointError(f"model.attention_bias=true cannot be exported as Hugging Face {self.name}")
        if a.sliding_window is not None and self.sliding not in ("mistral", "layers"):
            raise CheckpointError(f"model.sliding_window={a.sliding_window} cannot be exported as Hugging Face "
                                  f"{self.name} (family mistral has it)")

    # -------------------------------------------------------------- config.json -> model.* values
    def open_config(self, config: dict):
        """(a copy of config.json without the keys every family reads alike: architectures (must be this family's),
        model_type and the metadata keys; `refuse(msg)`, which raises one line naming the family)."""
        c = dict(config)
        where = f"config.json ({self.name})"

        def refuse(msg: str):
            raise CheckpointError(f"{where}: {msg}")

        archs = c.pop("architectures", None)
        if archs is not None and archs != [self.architecture]:
            refuse(f"architectures={archs} is not [{self.architecture!r}]")
        c.pop("model_type", None)
        for key in _METADATA_KEYS:
            c.pop(key, None)
        return c, refuse

    def read_config(self, config: dict) -> dict:
        c, refuse = self.open_config(config)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in c:
                refuse(f"required key {key!r} is missing")
        heads = c.pop("num_attention_heads")
        out = {"family": self.name, "vocab_size": c.pop("vocab_size"), "dim": c.pop("hidden_size"),
               "ffn_dim": c.pop("intermediate_size"), "n_layers": c.pop("num_hidden_layers"), "n_heads": heads,
               "n_kv_heads": c.pop("num_key_value_heads", None) or heads,
               "max_seq_len": c.pop("max_position_embeddings", self.default_max_positions),
               "norm_eps": float(c.pop("rms_norm_eps", 1e-6)),
               "tie_embeddings": bool(c.pop("tie_word_embeddings", False)),
               "init_std": float(c.pop("initializer_range", 0.02)),
               "bos_token_id": c.pop("bos_token_id", None), "eos_token_id": c.pop("eos_token_id", None),
               **self.fixed}
        hd = c.pop("head_dim", None)
        if hd is not None and hd != out["dim"] // heads:
            out["head_dim"] = hd
        act = c.pop("hidden_act", "silu")
        if act != "silu":
            refuse(f"hidden_act={act!r} is not supported ({self.name} here has silu, a SwiGLU MLP)")
        drop = c.pop("attention_dropout", 0.0)
        if drop:
            refuse(f"attention_dropout={drop} is not supported (meshforge has no dropout): set it to 0.0")
        out["pad_token_id"] = c.pop("pad_token_id", None)  # the embedding's padding_idx, as transformers builds it
        if self.reads_attention_bias:
            out["attention_bias"] = bool(c.pop("attention_bias", False))
        if self.reads_mlp_bias and c.pop("mlp_bias", False):
            refuse("mlp_bias=true is not supported (meshforge's SwiGLU MLP has no biases)")
        if self.reads_pretraining_tp:
            c.pop("pretraining_tp", None)
        if self.sliding == "mistral":
            out["sliding_window"] = c.pop("sliding_window", None)
        elif self.sliding == "qwen":
            if c.pop("use_sliding_window", False):
                refuse("use_sliding_window=true is not supported (sliding-window layers): set it to false")
            types = c.pop("layer_types", None)
            if types is not None and set(types) - {"full_attention"}:
                refuse(f"layer_types has {sorted(set(types) - {'full_attention'})}: only full_attention layers "
                       "are supported")
            c.pop("sliding_window", None)  # unused with use_sliding_window=false and full-attention layers
            c.pop("max_window_layers", None)  # likewise
        out.update(_read_rope(c, refuse))
        if c:
            refuse(f"key {sorted(c)[0]!r} is not read by meshforge's {self.name} family (unknown keys are "
                   "refused rather than ignored): remove it if it has no effect on the model")
        return out

    # -------------------------------------------------------------- model.* values -> config.json
    def write_config(self, a: ModelArgs, dtype: torch.dtype) -> dict:
        self.check_args(a)
        rope = {"rope_theta": a.rope_theta, "rope_type": a.rope_type}
        if a.rope_type == "llama3":
            rope.update({"factor": a.rope_factor, "low_freq_factor": a.rope_low_freq_factor,
                         "high_freq_factor": a.rope_high_freq_factor,
                         "original_max_position_embeddings": a.rope_original_max_seq_len})
        c = {"architectures": [self.architecture], "model_type": self.name, "vocab_size": a.vocab_size,
             "hidden_size": a.dim, "intermediate_size": a.ffn_dim, "num_hidden_layers": a.n_layers,
             "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.hd,
             "max_position_embeddings": a.max_seq_len, "rope_parameters": rope, "rms_norm_eps": a.norm_eps,
             "tie_word_embeddings": bool(a.tie_embeddings), "hidden_act": "silu", "attention_dropout": 0.0,
             "initializer_range": a.init_std, "bos_token_id": a.bos_token_id, "eos_token_id": a.eos_token_id,
             "pad_token_id": a.pad_token_id, "dtype": _DTYPE_NAMES.get(str(dtype), "float32"), "use_cache": True}
        if self.reads_attention_bias:
            c["attention_bias"] = bool(a.attention_bias)
        if self.reads_mlp_bias:
            c["mlp_bias"] = False
        if self.sliding == "mistral":
            c["sliding_window"] = a.sliding_window
        elif self.sliding == "qwen":
            c.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": a.n_layers,
                      "layer_types": ["full_attention"] * a.n_layers})
        return c

    def adapter(self, args: ModelArgs) -> DenseStateDictAdapter:
        return DenseStateDictAdapter(args, self)


def _read_rope(c: dict, refuse) -> dict:
    """RoPE of a dense family: `rope_type` default or llama3 (`rope_parameters` consumes the keys)."""
    params = rope_parameters(c, refuse)
    rope_type = params.pop("rope_type")
    out = {"rope_theta": float(params.pop("rope_theta", None) or 10000.0), "rope_type": rope_type}
    if rope_type == "llama3":
        keys = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings":
                "rope_original_max_seq_len"}
        for theirs, ours in keys.items():
            if theirs not in params:
                refuse(f"rope_type llama3 needs {theirs!r}")
            out[ours] = params.pop(theirs)
        out["rope_original_max_seq_len"] = int(out["rope_original_max_seq_len"])
    elif rope_type != "default":
        refuse(f"rope_type={rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    if params:
        refuse(f"rope parameter {sorted(params)[0]!r} is not supported for rope_type {rope_type}")
    return out


def rope_parameters(c: dict, refuse) -> dict:
    """The RoPE parameters of a config.json (consumed from `c`) in both layouts, transformers 5's `rope_parameters`
    and the older top-level `rope_theta` + `rope_scaling`, as one dict with `rope_type` (default when unset)."""
    params, scaling, theta = c.pop("rope_parameters", None), c.pop("rope_scaling", None), c.pop("rope_theta", None)
    if params is None:
        params = dict(scaling or {})
        if theta is not None:
            params["rope_theta"] = theta
    else:
        params = dict(params)
        if scaling is not None and scaling != {k: v for k, v in params.items() if k != "rope_theta"}:
            refuse("rope_scaling disagrees with rope_parameters: keep one")
        if theta is not None and params.get("rope_theta", theta) != theta:
            refuse(f"rope_theta={theta} disagrees with rope_parameters.rope_theta={params['rope_theta']}")
        params.setdefault("rope_theta", theta)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return {**params, "rope_type": rope_type}


# ------------------------------------------------------------------------------------ adapter
class DenseStateDictAdapter:
    """Tensor names and permutations for every dense family (they share HF's names); config.json by family."""

    patterns = _PATTERNS  # (meshforge name regex, HF name format); a family with other layers adds its own

    def __init__(self, args: ModelArgs, family: DenseFamily):
        self.args, self.family = args, family

    def hf_names(self, name: str) -> list[str]:
        if name == "output.weight" and self.args.tie_embeddings:
            return []  # the head shares the embedding's tensor; HF ties it back from config.json
        for pattern, theirs in self.patterns:
            m = pattern.match(name)
            if m:
                return [theirs.format(*m.groups())]
        raise KeyError(f"parameter {name} has no Hugging Face {self.args.family} name")

    def _heads(self, name: str) -> int | None:
        if re.search(r"attention\.wq\.(weight|bias)$", name):
            return self.args.n_heads
        if re.search(r"attention\.wk\.(weight|bias)$", name):
            return self.args.n_kv_heads
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1  # one head's worth of rows: the per-head order of the q/k features
        return None

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        heads = self._heads(name)
        return {theirs: (permute_to_hf(tensor, heads) if heads else tensor).contiguous()
                for theirs in self.hf_names(name)}

    def from_hf(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        (t,) = tensors.values()
        heads = self._heads(name)
        return permute_from_hf(t, heads) if heads else t

    def from_hf_box(self, name: str, read, box: list[tuple[int, int]]) -> torch.Tensor:
        """Only the part `box` ([(start, stop)] per dim) of the meshforge tensor, reading only what it needs:
        `read(hf_name, box)` reads a slice from the file. Permuted rows are read a whole head at a time."""
        (theirs,) = self.hf_names(name)
        heads = self._heads(name)
        if not heads:
            return read(theirs, box)
        (r0, r1), rest = box[0], box[1:]
        h = self.args.hd  # rows per head (the q/k norm weights are one head's rows)
        a, b = r0 // h * h, -(-r1 // h) * h
        if b <= a:
            return read(theirs, box)
        return permute_from_hf(read(theirs, [(a, b), *rest]), (b - a) // h)[r0 - a:r1 - a]

    def hf_config(self, dtype: torch.dtype | None = None) -> dict:  # None: float32
        return self.family.write_config(self.args, dtype)
