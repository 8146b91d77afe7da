"""Hugging Face Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`: Gemma 3 1B, and the text decoder of
the larger ones) <-> meshforge's `Gemma3` (models/gemma3.py).

config.json: Llama's keys (with transformers' Gemma 3 defaults where a key is missing: head_dim 256, tied
embeddings, pad/eos/bos 0/1/2) plus `hidden_activation` (gelu_pytorch_tanh only), `query_pre_attn_scalar`,
`sliding_window` with `layer_types` (or `sliding_window_pattern`), two rotary tables (`rope_parameters` by layer
type, or the older `rope_theta`, `rope_local_base_freq` and `rope_scaling`, which scales the global layers only;
local layers must be unscaled), `final_logit_softcapping`, and `cache_implementation` (generation only). Refused
with one line: `attn_logit_softcapping` other than null (transformers' Gemma3 attention does not apply it, so such a
checkpoint has no single meaning), `use_bidirectional_attention: true`, rope types other than default and linear,
any unknown key.

Tensors: Llama's names, with Gemma's four norms per layer (`input_layernorm`, `post_attention_layernorm` after
attention, `pre_feedforward_layernorm`, `post_feedforward_layernorm`) and QK-norm; q, k rows and the q/k norm
weights permuted per head as for Llama and Qwen3 (models/hf_dense.py). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError
from meshforge.models.family import Arg
from meshforge.models.hf_dense import _NAMES, DenseFamily, DenseStateDictAdapter, name_patterns
from meshforge.models.hf_layered import SLIDING_PATTERN, read_layer_pattern, read_rope_table, write_layer_pattern
from meshforge.models.layer_types import FULL, SLIDING

if TYPE_CHECKING:
    import torch

    from meshforge.models.args import ModelArgs

FIELDS = (SLIDING_PATTERN,
          Arg("rope_local_theta", float | None, None, "Gemma 3: RoPE base of the local (sliding-window) layers "
              "(rope_local_base_freq; None: rope_theta)", gt=0),
          Arg("query_pre_attn_scalar", int | None, None, "Gemma 3: attention scores scale by its -1/2 power "
              "(None: head_dim's)", gt=0),
          Arg("final_logit_softcap", float | None, None, "Gemma 3: logits become cap * tanh(logits / cap)", gt=0))

_NAMES_GEMMA3 = {**_NAMES, "layers.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
                 "layers.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
                 "layers.{}.post_ffn_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight"}

# transformers' Gemma3TextConfig defaults for keys that may be missing and differ from Llama's
_DEFAULTS = {"head_dim": 256, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
             "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "max_position_embeddings": 131072}


class Gemma3StateDictAdapter(DenseStateDictAdapter):
    patterns = name_patterns(_NAMES_GEMMA3)


@dataclass(frozen=True)
class Gemma3Family(DenseFamily):
    def read_config(self, config: dict) -> dict:
        c = {**_DEFAULTS, **config}
        where = f"config.json ({self.name})"

        def refuse(msg: str):
            raise CheckpointError(f"{where}: {msg}")

        if "num_hidden_layers" not in c:
            refuse("required key 'num_hidden_layers' is missing")
        act = c.pop("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            refuse(f"hidden_activation={act!r} is not supported (Gemma 3's GeGLU uses gelu_pytorch_tanh)")
        attn_cap = c.pop("attn_logit_softcapping", None)
        if attn_cap is not None:
            refuse(f"attn_logit_softcapping={attn_cap} is not supported: transformers' Gemma3 attention does not "
                   "apply it, so the checkpoint has no single meaning; set it to null")
        if c.pop("use_bidirectional_attention", False):
            refuse("use_bidirectional_attention=true is not supported (meshforge trains causal decoders)")
        c.pop("cache_implementation", None)  # which KV cache generate() uses: no effect on the model
        cap = c.pop("final_logit_softcapping", None)
        scalar = c.pop("query_pre_attn_scalar", 256)
        if scalar != int(scalar):
            refuse(f"query_pre_attn_scalar={scalar} must be an integer (transformers' type)")
        own = {"final_logit_softcap": None if cap is None else float(cap),
               "query_pre_attn_scalar": int(scalar)}
        own.update(read_layer_pattern(c, c["num_hidden_layers"], 4096, 6, refuse))
        own.update(self._read_rope(c, refuse, c["max_position_embeddings"]))
        return {**super().read_config(c), **own}

    @staticmethod
    def _read_rope(c: dict, refuse, max_pos: int) -> dict:
        """The global table (`full_attention`, scaled) and the local one (`sliding_attention`, its base only), from
        `rope_parameters` by layer type or the older top-level keys, as transformers merges them."""
        params = c.pop("rope_parameters", None) or {}
        scaling, theta, local = c.pop("rope_scaling", None), c.pop("rope_theta", None), c.pop("rope_local_base_freq",
                                                                                              None)
        if set(params) - {FULL, SLIDING}:
            refuse(f"rope_parameters must be given per layer type ({FULL}, {SLIDING}), got keys {sorted(params)}")
        full, sliding = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        if scaling:
            full.update(scaling)
        for key, value, table in (("rope_theta", theta, full), ("rope_local_base_freq", local, sliding)):
            if value is not None and table.get("rope_theta", value) != value:
                refuse(f"{key}={value} disagrees with rope_parameters' rope_theta={table['rope_theta']}")
        full.setdefault("rope_theta", theta if theta is not None else 1_000_000.0)
        sliding.setdefault("rope_theta", local if local is not None else 10_000.0)
        out = read_rope_table(full, ("default", "linear"), refuse, max_pos, f"rope_parameters.{FULL}")
        local_table = read_rope_table(sliding, ("default",), refuse, max_pos, f"rope_parameters.{SLIDING}")
        return {**out, "rope_local_theta": local_table["rope_theta"]}

    def write_config(self, a: ModelArgs, dtype: torch.dtype) -> dict:
        c = super().write_config(a, dtype)
        for key in ("hidden_act", "rope_parameters"):
            c.pop(key)
        full = {"rope_theta": a.rope_theta, "rope_type": a.rope_type}
        if a.rope_type == "linear":
            full["factor"] = a.rope_factor
        local = {"rope_theta": a.rope_theta if a.rope_local_theta is None else a.rope_local_theta,
                 "rope_type": "default"}
        scalar = a.query_pre_attn_scalar if a.query_pre_attn_scalar is not None else a.hd
        c.update({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
                  "final_logit_softcapping": a.final_logit_softcap, "attn_logit_softcapping": None,
                  "use_bidirectional_attention": False, "rope_parameters": {FULL: full, SLIDING: local},
                  **write_layer_pattern(a)})
        return c

    def adapter(self, args: ModelArgs) -> Gemma3StateDictAdapter:
        return Gemma3StateDictAdapter(args, self)


GEMMA3 = Gemma3Family("gemma3_text", "Gemma3ForCausalLM", fields=FIELDS, model="meshforge.models.gemma3:model_class",
                      description="meshforge.models.gemma3_shape:describe", rope_types=("default", "linear"),
                      exact_windows=True, packs_documents=True, fixed={"qkv_bias": False, "qk_norm": True},
                      reads_attention_bias=True, sliding="layers", default_max_positions=131072)
