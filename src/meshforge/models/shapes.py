"""The built-in models (llama.py's `Llama`, moe.py's `MoETransformer`) described without torch: module names,
parameter shapes, tied weights and the declared plans, for the process-free planner (`meshforge plan`,
validation's TP check), which must not pay torch's import (seconds) to list a 70B model's parameters.

`describe(args)` mirrors the modules' constructors one for one (same names, same order, same shapes, tied weights
as one shared `ParamShape`), and the declared plans and FLOPs live here, the models' contract methods returning
them; tests/unit/test_model_shapes.py checks every preset against the meta-device model. A change to a model's
constructor must be made here too (that test fails until it is).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.models.presets import ModelArgs
from meshforge.models.protocol import PipelineLayout

ADAPTER_PARTS = ("lora_A", "lora_B")  # LoRA's factor modules (models/lora.py)


def is_adapter_param(name: str) -> bool:
    """True for a LoRA parameter name (`...wq.lora_A.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_PARTS


@dataclass(eq=False)  # identity matters: a tied weight is one object under two module names, as in torch
class ParamShape:
    shape: tuple[int, ...]
    requires_grad: bool = True


class ModuleShape:
    """A torch-free stand-in for one nn.Module: its kind (the module's class name: "Linear", "RMSNorm",
    ...), its own parameters and its children, answering `named_modules` / `named_parameters` like torch does."""

    def __init__(self, kind: str, params: dict[str, ParamShape] | None = None,
                 children: dict[str, ModuleShape | None] | None = None):
        self.kind = kind
        self.params = params or {}
        self.children = {k: v for k, v in (children or {}).items() if v is not None}
        for k, v in self.children.items():
            setattr(self, k, v)
        for k, v in self.params.items():
            setattr(self, k, v)

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, child in self.children.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        mods = self.named_modules() if recurse else [("", self)]
        for mname, mod in mods:
            for pname, p in mod.params.items():
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{mname}.{pname}" if mname else pname), p

    def parameters(self):
        return (p for _, p in self.named_parameters())


def _linear(n_in: int, n_out: int, bias: bool = False) -> ModuleShape:
    params = {"weight": ParamShape((n_out, n_in))}
    if bias:
        params["bias"] = ParamShape((n_out,))
    return ModuleShape("Linear", params)


def _norm(dim: int) -> ModuleShape:
    return ModuleShape("RMSNorm", {"weight": ParamShape((dim,))})


def _feed_forward(dim: int, hidden: int) -> ModuleShape:
    return ModuleShape("FeedForward", children={"w1": _linear(dim, hidden), "w2": _linear(hidden, dim),
                                                 "w3": _linear(dim, hidden)})


def _attention(a: ModelArgs) -> ModuleShape:
    qkv_bias = a.attention_bias or a.qkv_bias
    children = {"wq": _linear(a.dim, a.n_heads * a.hd, qkv_bias), "wk": _linear(a.dim, a.n_kv_heads * a.hd, qkv_bias),
                "wv": _linear(a.dim, a.n_kv_heads * a.hd, qkv_bias),
                "wo": _linear(a.n_heads * a.hd, a.dim, a.attention_bias), "core": ModuleShape("CoreAttention")}
    if a.qk_norm:
        children.update(q_norm=_norm(a.hd), k_norm=_norm(a.hd))
    return ModuleShape("Attention", children=children)


def _moe(a: ModelArgs) -> ModuleShape:
    e, d, h = a.n_experts, a.dim, a.moe_ffn_dim
    experts = ModuleShape("GroupedExperts", {"w1": ParamShape((e, d, h)), "w3": ParamShape((e, d, h)),
                                      "w2": ParamShape((e, h, d))}, {"adapters": ModuleShape("ModuleDict")})
    shared = _feed_forward(d, h * a.n_shared_experts) if a.n_shared_experts > 0 else None
    return ModuleShape("MoE", children={"router": ModuleShape("Router", children={"gate": _linear(d, e)}),
                                        "experts": experts, "shared_experts": shared})


def _block(a: ModelArgs) -> ModuleShape:
    ff = _moe(a) if a.is_moe else _feed_forward(a.dim, a.ffn_dim)
    return ModuleShape("TransformerBlock", children={"attention_norm": _norm(a.dim), "attention": _attention(a),
                                          "ffn_norm": _norm(a.dim), "feed_forward": ff})


class ModelShape(ModuleShape):
    """The whole model's description, with the contract methods the planner asks (same answers as the model's)."""

    def __init__(self, args: ModelArgs):
        emb = ModuleShape("Embedding", {"weight": ParamShape((args.vocab_size, args.dim))})
        output = ModuleShape("Linear", {"weight": emb.weight if args.tie_embeddings
                                        else ParamShape((args.vocab_size, args.dim))})
        layers = ModuleShape("ModuleDict", children={str(i): _block(args) for i in range(args.n_layers)})
        children = {"tok_embeddings": emb, "layers": layers, "norm": _norm(args.dim), "output": output}
        super().__init__("MoETransformer" if args.is_moe else "Llama", children=children)
        self.args = args

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(self.args, sequence_parallel)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(tuple(f"layers.{k}" for k in self.layers.children), ("tok_embeddings",),
                              ("norm", "output"))

    def moe_layers(self) -> list[ModuleShape]:
        return [m for _, m in self.named_modules() if m.kind == "MoE"]

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.args, seq_len)


def describe(args: ModelArgs) -> ModelShape:
    """The built-in model `args` describes (not model.hf_model: that one is transformers' to build)."""
    if args.hf_model:
        raise ValueError("model.hf_model has no torch-free description: build it on the meta device")
    return ModelShape(args)


def tp_plan(args: ModelArgs, sequence_parallel: bool = False) -> dict[str, str]:
    return moe_tp_plan(sequence_parallel) if args.is_moe else dense_tp_plan(sequence_parallel)


def dense_tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """`Llama.tp_plan`: module-name patterns -> tensor-parallel style (distributed/tensor_parallel.py applies it)."""
    plan = {
        "tok_embeddings": "vocab_embedding",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "vocab_output",
    }
    if sequence_parallel:
        plan.update({"layers.*.attention_norm": "sequence_parallel", "layers.*.ffn_norm": "sequence_parallel",
                     "norm": "sequence_parallel",
                     # gather the sequence once per sub-layer for its column-wise projections
                     "layers.*.attention": "sequence_gather", "layers.*.feed_forward": "sequence_gather"})
    return plan


def moe_tp_plan(sequence_parallel: bool = False) -> dict[str, str]:
    """`MoETransformer.tp_plan`: attention and shared experts split as in Llama; router and routed experts stay
    whole (EP splits those)."""
    plan = {k: v for k, v in dense_tp_plan(sequence_parallel).items() if ".feed_forward." not in k}
    plan.update({"layers.*.feed_forward.shared_experts.w1": "colwise",
                 "layers.*.feed_forward.shared_experts.w3": "colwise",
                 "layers.*.feed_forward.shared_experts.w2": "rowwise"})
    return plan


def active_ffn_params_per_layer(a: ModelArgs) -> int:
    """Routed experts a token visits (top_k) + shared experts (hidden moe_ffn_dim * n_shared) + router."""
    return 3 * a.dim * a.moe_ffn_dim * (a.top_k + a.n_shared_experts) + a.dim * a.n_experts


def flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters, plus causal attention 6 * layers * heads * head_dim * seq
    (the PaLM formula's 12 * L * H * hd * S, halved for the causal mask)."""
    n = a.n_layers
    attn_proj = a.dim * a.hd * (2 * a.n_heads + 2 * a.n_kv_heads)
    dense_ffn = 3 * a.dim * a.ffn_dim
    ffn = active_ffn_params_per_layer(a) if a.is_moe else dense_ffn
    matmul = n * (attn_proj + ffn) + a.dim * a.vocab_size  # output projection (embedding lookup is free)
    # attention scores + weighted sum: 2 matmuls of S x S x head_dim per head, causal halves it
    attn = n * 2 * a.n_heads * a.hd * seq_len  # forward FLOPs/token: 2*2*S*hd*H / 2 (causal)
    return 6 * matmul + 3 * attn
