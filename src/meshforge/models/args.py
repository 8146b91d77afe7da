"""A model's fields, declared once: `ModelArgs` (what a preset and the model constructors hold) and, derived from
it, the config schema's `model` section (config/schema.py: each field an optional override of the preset, with
the bound and choices declared here). Torch-free.

One `Arg` line per field (models/family.py): name, type, default, the schema's bound or choices, one line of
doc. The shared fields are `SHARED` below; a family adds the fields only it reads in its own declaration
(`Family.fields`), and they join `ModelArgs` and the schema through the registry (models/hf_families.py);
set under another family such a field would be ignored, so `validate` refuses it.
`ModelArgs` is a frozen dataclass built from that list (so `dataclasses.fields`, `replace` and `asdict` work as
on any dataclass, and each field's `metadata["arg"]` is its `Arg`); its methods are `_ModelArgsMethods`'.
"""

from __future__ import annotations

import dataclasses

from meshforge.models.family import Arg
from meshforge.models.hf_dense import ROPE_TYPES
from meshforge.models.hf_families import FAMILIES

SHARED: tuple[Arg, ...] = (
    Arg("vocab_size", int, 256, "tokens in the vocabulary (embedding and output rows)", gt=0),
    Arg("dim", int, 64, "hidden size", gt=0),
    Arg("n_layers", int, 2, "transformer blocks", gt=0),
    Arg("n_heads", int, 4, "attention (query) heads", gt=0),
    Arg("n_kv_heads", int, 2, "key/value heads (grouped-query attention: divides n_heads)", gt=0),
    Arg("head_dim", int | None, None, "per-head width; None = dim / n_heads", gt=0),
    Arg("ffn_dim", int, 176, "SwiGLU MLP hidden size", gt=0),
    Arg("max_seq_len", int, 256, "context length the model is made for (config.json max_position_embeddings)",
        gt=0),
    Arg("rope_theta", float, 10000.0, "RoPE base", gt=0),
    Arg("norm_eps", float, 1e-5, "RMSNorm epsilon", gt=0),
    Arg("tie_embeddings", bool, False, "the output head shares the embedding's weight"),
    Arg("init_std", float, 0.02, "std of the normal initialisation (residual projections: / sqrt(2 n_layers))",
        gt=0),
    # mixture of experts (models/moe.py): n_experts == 0 means a dense model
    Arg("n_experts", int, 0, "routed experts per MoE layer (0: a dense model)", gt=0),
    Arg("n_shared_experts", int, 0, "shared experts: a SwiGLU of moe_ffn_dim * n_shared_experts every token takes",
        ge=0),
    Arg("top_k", int, 2, "experts each token is routed to", gt=0),
    Arg("moe_ffn_dim", int, 0, "hidden size of each expert", gt=0),
    Arg("score_func", str, "softmax", "router scores", choices=("softmax", "sigmoid")),
    Arg("route_norm", bool, True, "renormalise the top-k weights to sum to 1"),
    Arg("aux_loss_coeff", float, 0.01, "load-balancing loss coefficient", ge=0),
    Arg("router_bias_update_rate", float, 0.0, "auxiliary-loss-free balancing (DeepSeek-V3): after each step every "
        "expert's selection bias moves by this rate towards the mean load (0: off)", ge=0),
    # Hugging Face families (models/hf_*.py; `meshforge checkpoint import` prints these for a config.json): the
    # family names the HF architecture; the flags are its layers
    Arg("family", str, "llama", "Hugging Face family: its architecture, config.json keys and tensor names",
        choices=tuple(FAMILIES)),
    Arg("attention_bias", bool, False, "biases on q, k, v and o (HF `attention_bias`)"),
    Arg("qkv_bias", bool, False, "biases on q, k, v only (Qwen2)"),
    Arg("qk_norm", bool, False, "per-head RMSNorm of q and k before RoPE (Qwen3)"),
    Arg("rope_type", str, "default", "llama3: Llama 3.1/3.2 frequency scaling (the four keys below); linear, yarn: "
        "the families that name them (gemma3_text; gpt_oss and deepseek_v3: rope_factor, rope_original_max_seq_len "
        "and their yarn_* keys)", choices=ROPE_TYPES),
    Arg("rope_factor", float, 8.0, "llama3, linear and yarn scaling: factor", gt=0),
    Arg("rope_low_freq_factor", float, 1.0, "llama3 scaling: low_freq_factor", gt=0),
    Arg("rope_high_freq_factor", float, 4.0, "llama3 scaling: high_freq_factor", gt=0),
    Arg("rope_original_max_seq_len", int, 8192, "llama3 and yarn scaling: original context length", gt=0),
    Arg("sliding_window", int | None, None, "keys a sliding-window layer sees (Gemma 3, GPT-OSS: the local layers; "
        "Mistral: every layer, exact while training.seq_len <= it, a rule refuses longer)", gt=0),
    Arg("bos_token_id", int | None, None, "written to generation_config.json on export", ge=0),
    Arg("eos_token_id", int | list[int] | None, None, "likewise"),
    Arg("pad_token_id", int | None, None, "HF padding_idx: that embedding row gets no gradient from the lookup "
        "(no tp)", ge=0),
    # any transformers causal LM (models/hf_auto.py): the fields above then describe its shape for rules and the
    # planner, and build_model builds the transformers model itself
    Arg("hf_model", str | None, None, "a transformers model folder or its config.json"),
)


def _collect(shared: tuple[Arg, ...], families) -> tuple[Arg, ...]:
    """The shared fields, then each family's own (a field two families declare must be declared alike)."""
    out = {a.name: a for a in shared}
    for f in families:
        for a in f.fields:
            if out.setdefault(a.name, a) != a:
                raise ValueError(f"model field {a.name!r} of family {f.name} differs from its other declaration")
    return tuple(out.values())


# a family's own field -> the families that read it: set under another family it would be silently ignored
_READERS = {a.name: [f.name for f in FAMILIES.values() if a in f.fields]
            for family in FAMILIES.values() for a in family.fields}


class _ModelArgsMethods:
    """What ModelArgs computes from its fields."""

    @property
    def is_moe(self) -> bool:
        """Some layer routes tokens to experts (DeepSeek's first `first_k_dense` layers are dense)."""
        return self.n_experts > 0 and self.first_k_dense < self.n_layers

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
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not one of {', '.join(FAMILIES)}")
        rope_types = FAMILIES[self.family].rope_types
        if self.rope_type not in rope_types:
            raise ValueError(f"model.rope_type={self.rope_type!r} must be {' or '.join(rope_types)} for "
                             f"model.family={self.family}")
        if self.rope_type == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor (llama3 RoPE)")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"model.pad_token_id={self.pad_token_id} is outside the vocabulary (model.vocab_size="
                             f"{self.vocab_size})")
        if self.is_moe and not (1 <= self.top_k <= self.n_experts):
            raise ValueError(f"model.top_k={self.top_k} must be between 1 and model.n_experts={self.n_experts}")
        FAMILIES[self.family].validate(self)
        for name, readers in _READERS.items():
            field = type(self).__dataclass_fields__[name]
            if self.family not in readers and getattr(self, name) != field.default:
                raise ValueError(f"model.{name} is read only by model.family={' or '.join(readers)}, not by "
                                 f"{self.family}: remove it or set model.family")
        return self


def model_args_class(args: tuple[Arg, ...]) -> type:
    """A frozen dataclass with one field per `Arg`, in order (each field's metadata["arg"] is its Arg)."""
    specs = [(a.name, a.type, dataclasses.field(default=a.default, metadata={"arg": a})) for a in args]
    return dataclasses.make_dataclass(
        "ModelArgs", specs, bases=(_ModelArgsMethods,), frozen=True,
        namespace={"__module__": __name__, "__doc__": "A model's resolved fields (models/args.py declares them).",
                   "__hash__": _hash})


def _hash(args) -> int:
    """The planner caches by ModelArgs: a list field (several `eos_token_id`s, as transformers' GLM config gives)
    hashes as a tuple (the generated hash raised TypeError: `meshforge plan` crashed on such a model). The values
    are read from the instance's dict, which holds exactly the fields in order (the dataclass sets nothing else):
    `dataclasses.fields` made hashing 5x slower, and `plan --fit` hashes ModelArgs thousands of times."""
    return hash(tuple([tuple(v) if isinstance(v, list) else v for v in vars(args).values()]))


ModelArgs = model_args_class(_collect(SHARED, FAMILIES.values()))


def model_fields() -> tuple[Arg, ...]:
    """Every model field, in `ModelArgs` order: what the schema's `model` section is derived from."""
    return tuple(f.metadata["arg"] for f in dataclasses.fields(ModelArgs))
