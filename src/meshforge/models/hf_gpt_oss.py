"""Hugging Face GPT-OSS (`GptOssForCausalLM`, model_type `gpt_oss`) <-> meshforge's `GptOss` (models/gpt_oss.py).

config.json: Mixtral's MoE keys (`num_local_experts`, `num_experts_per_tok`, `intermediate_size` = each expert's
hidden size, `router_aux_loss_coef`), plus `attention_bias`, `sliding_window` with `layer_types` (every other layer
local: `model.sliding_window_pattern` 2), the clamped SwiGLU's `swiglu_alpha` / `swiglu_limit`, and a default or
YaRN rotary table (`rope_parameters`, or the older `rope_theta` + `rope_scaling`). OpenAI's own keys in the
published configs, `experts_per_token` and `initial_context_length`, are accepted when they repeat
`num_experts_per_tok` and YaRN's `original_max_position_embeddings` (transformers ignores them). Refused with one
line: a quantisation (`quantization_config`: the published MXFP4 experts; dequantise to bf16 first), `hidden_act`
other than silu (transformers ignores it: the experts always use the clamped SwiGLU), YaRN's `mscale` keys, any
unknown key.

Tensors: transformers' names, with the experts as stored (fused, interleaved `gate_up_proj` (E, dim, 2 x hidden)
and `down_proj`, their biases, one tensor per layer each), the sinks `self_attn.sinks`, the router
`mlp.router.weight` / `.bias`; q and k rows permuted per head as for Llama (models/hf_dense.py). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError
from meshforge.models.family import Arg
from meshforge.models.hf_dense import _NAMES, DenseStateDictAdapter, name_patterns
from meshforge.models.hf_layered import (
    SLIDING_PATTERN,
    read_layer_pattern,
    read_rope_table,
    write_layer_pattern,
    write_rope_table,
)
from meshforge.models.hf_moe import MoEFamily
from meshforge.models.yarn import YARN_RAMP_FIELDS

if TYPE_CHECKING:
    import torch

    from meshforge.models.args import ModelArgs

FIELDS = (SLIDING_PATTERN,
          Arg("swiglu_alpha", float, 1.702, "GPT-OSS experts: the sigmoid gain of the clamped SwiGLU", gt=0),
          Arg("swiglu_limit", float, 7.0, "GPT-OSS experts: the clamp of gate (above) and up (both sides)", gt=0),
          *YARN_RAMP_FIELDS)

_NAMES_GPT_OSS = {**_NAMES,
                  "layers.{}.attention.sinks.weight": "model.layers.{}.self_attn.sinks",
                  "layers.{}.feed_forward.router.gate.weight": "model.layers.{}.mlp.router.weight",
                  "layers.{}.feed_forward.router.gate.bias": "model.layers.{}.mlp.router.bias",
                  **{f"layers.{{}}.feed_forward.experts.{p}": f"model.layers.{{}}.mlp.experts.{p}"
                     for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}}
_NAMES_GPT_OSS = {k: v for k, v in _NAMES_GPT_OSS.items() if ".feed_forward.w" not in k}


class GptOssStateDictAdapter(DenseStateDictAdapter):
    """Dense names for attention and norms (q/k permuted per head), and GPT-OSS's own tensors one to one."""

    patterns = name_patterns(_NAMES_GPT_OSS)


@dataclass(frozen=True)
class GptOssFamily(MoEFamily):
    """GPT-OSS's config.json: the MoE keys as Mixtral's, plus its windows, sinks (always), SwiGLU and YaRN."""

    def check_args(self, a: ModelArgs) -> None:
        if not a.route_norm:
            raise CheckpointError("model.route_norm=false: Hugging Face gpt_oss takes the softmax over the top k")
        super().check_args(a)

    def read_config(self, config: dict) -> dict:
        c = dict(config)
        where = f"config.json ({self.name})"

        def refuse(msg: str):
            raise CheckpointError(f"{where}: {msg}")

        if c.get("quantization_config") is not None:
            method = c["quantization_config"].get("quant_method", "?") if isinstance(c["quantization_config"],
                                                                                     dict) else "?"
            refuse(f"quantization_config ({method}) is not supported: meshforge trains bf16/fp32 weights; "
                   "dequantise the checkpoint first (e.g. transformers' Mxfp4Config(dequantize=True), save_pretrained)")
        c.pop("quantization_config", None)
        for key in ("num_hidden_layers", "num_experts_per_tok"):
            if key not in c:
                refuse(f"required key {key!r} is missing")
        own = {"swiglu_alpha": float(c.pop("swiglu_alpha", 1.702)), "swiglu_limit": float(c.pop("swiglu_limit", 7.0)),
               "score_func": "softmax", "route_norm": True}
        legacy_k = c.pop("experts_per_token", None)
        if legacy_k is not None and legacy_k != c["num_experts_per_tok"]:
            refuse(f"experts_per_token={legacy_k} disagrees with num_experts_per_tok={c['num_experts_per_tok']}")
        own.update(read_layer_pattern(c, c["num_hidden_layers"], 128, 2, refuse))
        max_pos = c.get("max_position_embeddings", self.default_max_positions)
        own.update(self._read_rope(c, refuse, max_pos))
        c.setdefault("attention_bias", True)  # transformers' default for GPT-OSS
        c.setdefault("head_dim", 64)
        c.setdefault("num_key_value_heads", 8)
        c.setdefault("rms_norm_eps", 1e-5)
        return {**super().read_config(c), **own}

    @staticmethod
    def _read_rope(c: dict, refuse, max_pos: int) -> dict:
        """`rope_scaling` wins over `rope_parameters` (as transformers reads them); no table at all: GPT-OSS's
        default YaRN (factor 32, original context 4096, truncate false)."""
        params, scaling, theta = c.pop("rope_parameters", None), c.pop("rope_scaling", None), c.pop("rope_theta", None)
        table = dict(scaling or params or {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 4096})
        if theta is not None and table.get("rope_theta", theta) != theta:
            refuse(f"rope_theta={theta} disagrees with the rope parameters' rope_theta={table['rope_theta']}")
        table.setdefault("rope_theta", theta if theta is not None else 150000.0)
        out = read_rope_table(table, ("default", "yarn"), refuse, max_pos, yarn_fields=YARN_RAMP_FIELDS)
        initial = c.pop("initial_context_length", None)  # OpenAI's name for YaRN's original context
        if initial is not None and initial != out.get("rope_original_max_seq_len", initial):
            refuse(f"initial_context_length={initial} disagrees with original_max_position_embeddings="
                   f"{out.get('rope_original_max_seq_len')}")
        return out

    def write_config(self, a: ModelArgs, dtype: torch.dtype) -> dict:
        c = super().write_config(a, dtype)
        c.pop("rope_parameters")
        c.update({"rope_parameters": write_rope_table(a), "swiglu_alpha": a.swiglu_alpha,
                  "swiglu_limit": a.swiglu_limit, **write_layer_pattern(a)})
        return c

    def adapter(self, args: ModelArgs) -> GptOssStateDictAdapter:
        return GptOssStateDictAdapter(args, self)


GPT_OSS = GptOssFamily("gpt_oss", "GptOssForCausalLM", fields=FIELDS, model="meshforge.models.gpt_oss:model_class",
                       description="meshforge.models.gpt_oss_shape:describe", rope_types=("default", "yarn"),
                       exact_windows=True, packs_documents=True,
                       fixed={"qkv_bias": False, "qk_norm": False, "n_shared_experts": 0},
                       reads_attention_bias=True, sliding="layers", default_max_positions=131072,
                       block="mlp", moe_ffn_key=None, route_norm_key=None)
