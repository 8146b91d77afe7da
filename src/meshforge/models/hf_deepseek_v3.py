"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, and the models built on its architecture): config.json both
ways and the tensor names. The model is models/deepseek_v3.py, described in models/deepseek_v3_shapes.py.

Every config.json key is honoured or refused with one line naming it (docs/hf.md lists them). Refused: multi-token
prediction layers (`num_nextn_predict_layers` > 0: the MTP module is not built here yet), quantization configs
(block-quantized fp8 weights: dequantize first), RoPE types other than default and yarn, the original remote
code's training-only keys (`aux_loss_alpha`, `seq_aux`), and any key not listed below. The experts are the hub's
per-expert layout (`mlp.experts.{e}.gate_proj/up_proj/down_proj`, transformers 5 fuses them in memory only), the
router `mlp.gate.weight` with its selection bias `mlp.gate.e_score_correction_bias`, a persistent buffer here too
(`router.expert_bias`: auxiliary-loss-free balancing updates it, checkpoints keep it). No tensor is permuted: the
rotary half of q and k is rotated as interleaved pairs (`rope_interleave: true`, what DeepSeek ships) or as halves
(`false`) by the model itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError
from meshforge.models.family import Arg, _resolve
from meshforge.models.hf_dense import _DTYPE_NAMES, rope_parameters
from meshforge.models.hf_layered import read_rope_table, write_rope_table
from meshforge.models.hf_moe import MoEFamily, MoEStateDictAdapter
from meshforge.models.yarn import YARN_FIELDS

if TYPE_CHECKING:
    import torch

    from meshforge.models.args import ModelArgs

FIELDS: tuple[Arg, ...] = (
    Arg("q_lora_rank", int, 0, "DeepSeek MLA: rank of the compressed query (0: one full q projection, HF null)", ge=0),
    Arg("kv_lora_rank", int, 32, "DeepSeek MLA: rank of the compressed key/value latent", gt=0),
    Arg("qk_nope_head_dim", int, 16, "DeepSeek MLA: per-head query/key width without RoPE", gt=0),
    Arg("qk_rope_head_dim", int, 8, "DeepSeek MLA: per-head query/key width with RoPE (the key's is shared)", gt=0),
    Arg("v_head_dim", int, 16, "DeepSeek MLA: per-head value width", gt=0),
    Arg("rope_interleave", bool, True, "DeepSeek: RoPE rotates interleaved pairs (true) or halves (false)"),
    Arg("first_k_dense", int, 0, "DeepSeek: the first layers have a dense SwiGLU of ffn_dim, the others experts",
        ge=0),
    Arg("n_group", int, 1, "DeepSeek routing: expert groups; a token's experts come from its topk_group best", gt=0),
    Arg("topk_group", int, 1, "DeepSeek routing: groups a token may use", gt=0),
    Arg("routed_scaling_factor", float, 1.0, "DeepSeek routing: the routed experts' weights are multiplied by it",
        gt=0),
) + YARN_FIELDS

# meshforge name -> HF name (`{}` the layer index); the routed experts are MoEStateDictAdapter's
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    **{f"layers.{{}}.attention.{ours}.{t}": f"model.layers.{{}}.self_attn.{theirs}.{t}"
       for ours, theirs in (("wq", "q_proj"), ("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"),
                            ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"),
                            ("wo", "o_proj"))
       for t in ("weight", "bias")},
    **{f"layers.{{}}.feed_forward.{part}{ours}.weight": f"model.layers.{{}}.mlp.{part}{theirs}.weight"
       for part in ("", "shared_experts.")
       for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))},
    "layers.{}.feed_forward.router.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias",
}
_PATTERNS = [(re.compile("^" + re.escape(ours).replace(r"\{\}", r"(\d+)") + "$"), theirs)
             for ours, theirs in _NAMES.items()]

# config.json keys that do not change the weights or the logits
_ACCEPTED = {"pretraining_tp", "output_router_logits", "ep_size", "auto_map"}
# keys accepted only with this value (the original remote code's, and transformers' multi-token prediction)
_MUST_BE = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu",
            "attention_dropout": 0.0, "num_nextn_predict_layers": 0, "num_mtp_layers": 0}
_WHY = {"num_nextn_predict_layers": "multi-token prediction layers are not built here yet: set it to 0 (the MTP "
                                    "module's weights are then not read)",
        "num_mtp_layers": "multi-token prediction layers are not built here yet: set it to 0",
        "quantization_config": "quantized weights (e.g. fp8 with block scales) are not read: dequantize the "
                               "checkpoint to bf16 first",
        "aux_loss_alpha": "the original code's sequence-wise balance loss is not meshforge's: remove it and set "
                          "model.aux_loss_coeff / model.router_bias_update_rate",
        "seq_aux": "the original code's sequence-wise balance loss is not meshforge's: remove it"}


@dataclass(frozen=True)
class DeepSeekV3Family(MoEFamily):
    """config.json <-> model.* for DeepSeek-V3; the experts' tensor layout is MoEFamily's (`mlp.experts.{e}`)."""

    def check_args(self, a: ModelArgs) -> None:
        """What `validate` lets through but config.json cannot say."""
        if a.is_moe and not a.n_shared_experts:
            raise CheckpointError(f"model.n_shared_experts=0: Hugging Face {self.name} always builds shared experts "
                                  "(zero-width ones are not supported here)")

    def validate(self, a: ModelArgs) -> None:
        """Besides the routing's arithmetic, the shared fields latent attention has no use for must not be set
        (they would be silently ignored)."""
        if a.n_kv_heads != a.n_heads:
            raise ValueError(f"model.n_kv_heads={a.n_kv_heads} must equal model.n_heads={a.n_heads} for "
                             f"model.family={self.name} (latent attention expands a key and value per head)")
        if a.head_dim is not None and a.head_dim != a.qk_nope_head_dim + a.qk_rope_head_dim:
            raise ValueError(f"model.head_dim={a.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                             f"{a.qk_nope_head_dim + a.qk_rope_head_dim} for model.family={self.name}")
        for key, value in (("qkv_bias", True), ("qk_norm", True), ("score_func", "softmax")):
            if getattr(a, key) == value:
                raise ValueError(f"model.{key}={value} is not read by model.family={self.name} (latent attention; "
                                 "a sigmoid router): remove it")
        if a.sliding_window is not None:
            raise ValueError(f"model.sliding_window is not read by model.family={self.name}: remove it")
        if a.n_experts == 0:
            return
        if a.n_experts % a.n_group:
            raise ValueError(f"model.n_experts={a.n_experts} is not divisible by model.n_group={a.n_group}")
        if a.n_group > 1 and a.n_experts // a.n_group < 2:
            raise ValueError(f"model.n_group={a.n_group} leaves fewer than 2 experts per group (a group's score is "
                             "its two best experts')")
        if a.topk_group > a.n_group:
            raise ValueError(f"model.topk_group={a.topk_group} exceeds model.n_group={a.n_group}")
        if a.top_k > a.topk_group * (a.n_experts // a.n_group):
            raise ValueError(f"model.top_k={a.top_k} exceeds the experts of model.topk_group={a.topk_group} groups")
        if a.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={a.qk_rope_head_dim} must be even for rotary embeddings")

    def stand_ins(self, args: ModelArgs):
        return _resolve("meshforge.models.deepseek_v3_shapes:stand_ins")(args)  # by name: it imports the shapes

    # -------------------------------------------------------------- config.json -> model.* values
    def read_config(self, config: dict) -> dict:
        c, refuse = self.open_config(config)
        for key in _ACCEPTED:
            c.pop(key, None)
        for key, why in _WHY.items():
            if key in c and (key not in _MUST_BE or c[key] != _MUST_BE[key]):
                refuse(f"{key}={c[key]!r} is not supported: {why}")
        for key, value in _MUST_BE.items():
            got = c.pop(key, value)
            if got != value:
                refuse(f"{key}={got!r} is not supported (only {value!r})")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if c.get(key) is None:
                refuse(f"required key {key!r} is missing")
        heads = c.pop("num_attention_heads")
        kv_heads = c.pop("num_key_value_heads", None) or heads
        if kv_heads != heads:
            refuse(f"num_key_value_heads={kv_heads} differs from num_attention_heads={heads} (latent attention "
                   "expands one key and value per query head)")
        nope, rope, v = c.pop("qk_nope_head_dim"), c.pop("qk_rope_head_dim"), c.pop("v_head_dim")
        for key, derived in (("head_dim", rope), ("qk_head_dim", nope + rope)):  # transformers writes both
            got = c.pop(key, derived)
            if got != derived:
                refuse(f"{key}={got} disagrees with qk_rope_head_dim={rope} / qk_nope_head_dim={nope}")
        n_layers = c.pop("num_hidden_layers")
        experts = {c.pop(k) for k in ("n_routed_experts", "num_local_experts") if k in c}
        if len(experts) != 1:
            refuse(f"needs one number of routed experts (n_routed_experts), got {sorted(experts, key=str)}")
        first_dense = c.pop("first_k_dense_replace", 3)
        for key in ("n_group", "topk_group", "num_experts_per_tok", "moe_intermediate_size"):
            if c.get(key, 0) is None:
                refuse(f"{key}=null is not supported: give a number")
        if not c.get("n_shared_experts", 1):
            refuse(f"n_shared_experts={c['n_shared_experts']} is not supported (transformers then builds "
                   "zero-width shared experts)")
        out = {"family": self.name, "vocab_size": c.pop("vocab_size"), "dim": c.pop("hidden_size"),
               "ffn_dim": c.pop("intermediate_size"), "n_layers": n_layers, "n_heads": heads, "n_kv_heads": heads,
               "head_dim": nope + rope, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
               "kv_lora_rank": c.pop("kv_lora_rank"), "q_lora_rank": c.pop("q_lora_rank", 1536) or 0,
               "n_experts": experts.pop(), "top_k": c.pop("num_experts_per_tok", 8),
               "moe_ffn_dim": c.pop("moe_intermediate_size", 2048),
               "n_shared_experts": c.pop("n_shared_experts", 1),
               "routed_scaling_factor": float(c.pop("routed_scaling_factor", 2.5)),
               "n_group": c.pop("n_group", 8), "topk_group": c.pop("topk_group", 4),
               "first_k_dense": min(first_dense if first_dense is not None else 0, n_layers),
               "route_norm": bool(c.pop("norm_topk_prob", True)), "score_func": "sigmoid",
               "aux_loss_coeff": 0.0,  # auxiliary-loss-free by design; transformers computes no balance loss
               "rope_interleave": bool(c.pop("rope_interleave", True)),
               "attention_bias": bool(c.pop("attention_bias", False)),
               "max_seq_len": c.pop("max_position_embeddings", 4096),
               "norm_eps": float(c.pop("rms_norm_eps", 1e-6)),
               "tie_embeddings": bool(c.pop("tie_word_embeddings", False)),
               "init_std": float(c.pop("initializer_range", 0.02)),
               "bos_token_id": c.pop("bos_token_id", None), "eos_token_id": c.pop("eos_token_id", None),
               "pad_token_id": c.pop("pad_token_id", None)}
        out.update(self._read_rope(c, out["max_seq_len"], refuse))
        if c:
            refuse(f"key {sorted(c)[0]!r} is not read by meshforge's {self.name} family (unknown keys are "
                   "refused rather than ignored): remove it if it has no effect on the model")
        return out

    @staticmethod
    def _read_rope(c: dict, max_positions: int, refuse) -> dict:
        """Both layouts (models/hf_dense.py's `rope_parameters`), one default or yarn table (every YaRN key)."""
        params = rope_parameters(c, refuse)
        params["rope_theta"] = params.get("rope_theta") or 10000.0
        return read_rope_table(params, ("default", "yarn"), refuse, max_positions, yarn_fields=YARN_FIELDS)

    # -------------------------------------------------------------- model.* values -> config.json
    def write_config(self, a: ModelArgs, dtype: torch.dtype) -> dict:
        self.check_args(a)
        rope = write_rope_table(a)
        return {"architectures": [self.architecture], "model_type": self.name, "vocab_size": a.vocab_size,
                "hidden_size": a.dim, "intermediate_size": a.ffn_dim, "moe_intermediate_size": a.moe_ffn_dim,
                "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads,
                "n_shared_experts": a.n_shared_experts, "n_routed_experts": a.n_experts,
                "routed_scaling_factor": a.routed_scaling_factor, "kv_lora_rank": a.kv_lora_rank,
                "q_lora_rank": a.q_lora_rank or None, "qk_rope_head_dim": a.qk_rope_head_dim,
                "v_head_dim": a.v_head_dim, "qk_nope_head_dim": a.qk_nope_head_dim, "n_group": a.n_group,
                "topk_group": a.topk_group, "num_experts_per_tok": a.top_k, "first_k_dense_replace": a.first_k_dense,
                "norm_topk_prob": bool(a.route_norm), "hidden_act": "silu", "max_position_embeddings": a.max_seq_len,
                "initializer_range": a.init_std, "rms_norm_eps": a.norm_eps, "tie_word_embeddings":
                bool(a.tie_embeddings), "rope_parameters": rope, "rope_interleave": bool(a.rope_interleave),
                "attention_bias": bool(a.attention_bias), "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
                "output_router_logits": False, "bos_token_id": a.bos_token_id, "eos_token_id": a.eos_token_id,
                "pad_token_id": a.pad_token_id, "dtype": _DTYPE_NAMES.get(str(dtype), "float32"),
                "use_cache": True}

    def adapter(self, args: ModelArgs) -> DeepSeekV3StateDictAdapter:
        return DeepSeekV3StateDictAdapter(args, self)


class DeepSeekV3StateDictAdapter(MoEStateDictAdapter):
    """Attention, dense MLPs, shared experts, norms and the router's bias by name (no permutation); the router
    gate and the stacked routed experts as MoEStateDictAdapter splits them per expert."""

    def hf_names(self, name: str) -> list[str]:
        if name == "output.weight" and self.args.tie_embeddings:
            return []
        for pattern, theirs in _PATTERNS:
            m = pattern.match(name)
            if m:
                return [theirs.format(*m.groups())]
        return super().hf_names(name)

    def _heads(self, name: str) -> None:
        return None  # nothing is permuted (module docstring)


DEEPSEEK_V3 = DeepSeekV3Family("deepseek_v3", "DeepseekV3ForCausalLM", fields=FIELDS,
                               model="meshforge.models.deepseek_v3:model_class",
                               description="meshforge.models.deepseek_v3_shapes:describe",
                               rope_types=("default", "yarn"), packs_documents=True)
