"""The built-in models (llama.py's `Llama`, moe.py's `MoETransformer`) described without torch: module names,
parameter shapes, tied weights and the declared plans. The models are built from these descriptions
(models/materialize.py), and the process-free planner (`meshforge plan`, validation's TP check) reads them
without paying torch's import (seconds) to list a 70B model's parameters: a structural change is made here, once.

Each function below describes one module class: its children and parameters in order, and in `init` the class's
constructor arguments (the module's `__init__` calls the same function and builds what it lists). `describe(args)`
is the whole model (a tied weight is one shared `ParamShape`, as in torch), `apply_lora` adapts it as
models/lora.py adapts the model (both build the adapters from `lora_adapters` / `expert_lora`). The declared TP
plans, adapter layouts and FLOPs live here too, the models' contract methods returning them.
tests/unit/test_model_shapes.py checks every preset (and LoRA on them) against the meta-device model.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Any

from meshforge.models.args import ModelArgs
from meshforge.models.layer_types import keys_per_query, window_of
from meshforge.models.protocol import AdapterLayout, PipelineLayout, contract_of

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
    ...), its own parameters, its children (None: a slot the module leaves empty, as torch's `_modules` holds
    it), and `init`, the class's constructor arguments; it answers `named_modules` / `named_parameters` like
    torch does."""

    def __init__(self, kind: str, params: dict[str, ParamShape] | None = None,
                 children: dict[str, ModuleShape | None] | None = None, init: tuple = ()):
        self.kind = kind
        self.params = params or {}
        self.children = dict(children or {})
        self.init = init
        for k, v in self.children.items():
            setattr(self, k, v)
        for k, v in self.params.items():
            setattr(self, k, v)

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for name, child in self.children.items():
            if child is not None:
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

    def get_submodule(self, name: str) -> ModuleShape:
        mod = self
        for part in name.split("."):
            mod = mod.children[part]
        return mod


# ------------------------------------------------------------------ one function per module class
def linear(n_in: int, n_out: int, bias: bool = False) -> ModuleShape:
    params = {"weight": ParamShape((n_out, n_in))}
    if bias:
        params["bias"] = ParamShape((n_out,))
    return ModuleShape("Linear", params, init=(n_in, n_out, bias))


def rms_norm(dim: int, eps: float, zero_centred: bool = False) -> ModuleShape:
    """`llama.RMSNorm`; `zero_centred`: its scale is 1 + weight (Gemma 3)."""
    return ModuleShape("RMSNorm", {"weight": ParamShape((dim,))}, init=(dim, eps, True) if zero_centred else (dim, eps))


def feed_forward(dim: int, hidden: int) -> ModuleShape:
    """SwiGLU: w1 (gate), w2 (down), w3 (up)."""
    return ModuleShape("FeedForward", children={"w1": linear(dim, hidden), "w2": linear(hidden, dim),
                                                 "w3": linear(dim, hidden)}, init=(dim, hidden))


def attention(a: ModelArgs) -> ModuleShape:
    """q, k, v, o projections (biases: `attention_bias` on all four, `qkv_bias` on q, k, v), the swappable
    attention kernel `core` (an attention slot), and Qwen3's per-head q/k norms."""
    qkv_bias = a.attention_bias or a.qkv_bias
    children = {"wq": linear(a.dim, a.n_heads * a.hd, qkv_bias), "wk": linear(a.dim, a.n_kv_heads * a.hd, qkv_bias),
                "wv": linear(a.dim, a.n_kv_heads * a.hd, qkv_bias),
                "wo": linear(a.n_heads * a.hd, a.dim, a.attention_bias), "core": ModuleShape("CoreAttention")}
    if a.qk_norm:
        children.update(q_norm=rms_norm(a.hd, a.norm_eps), k_norm=rms_norm(a.hd, a.norm_eps))
    return ModuleShape("Attention", children=children, init=(a,))


def router(dim: int, n_experts: int, top_k: int, score_func: str, route_norm: bool,
           bias_update_rate: float = 0.0, bias: bool = False) -> ModuleShape:
    """The gate (with a bias: GPT-OSS); with `bias_update_rate` > 0 also the balancing bias, a buffer (not a
    parameter: not described)."""
    init = (dim, n_experts, top_k, score_func, route_norm, bias_update_rate) + ((True,) if bias else ())
    return ModuleShape("Router", children={"gate": linear(dim, n_experts, bias)}, init=init)


def grouped_experts(n_experts: int, dim: int, hidden: int) -> ModuleShape:
    """The routed experts stacked: w1, w3 (E, dim, hidden), w2 (E, hidden, dim); per-expert LoRA under `adapters`."""
    e, d, h = n_experts, dim, hidden
    return ModuleShape("GroupedExperts", {"w1": ParamShape((e, d, h)), "w3": ParamShape((e, d, h)),
                                          "w2": ParamShape((e, h, d))},
                       {"adapters": ModuleShape("ModuleDict")}, init=(e, d, h))


def moe(a: ModelArgs) -> ModuleShape:
    """Router, routed experts, and shared experts (a SwiGLU of moe_ffn_dim * n_shared_experts) if any."""
    d, h = a.dim, a.moe_ffn_dim
    shared = feed_forward(d, h * a.n_shared_experts) if a.n_shared_experts > 0 else None
    return ModuleShape("MoE", children={"router": router(d, a.n_experts, a.top_k, a.score_func, a.route_norm,
                                                         a.router_bias_update_rate),
                                        "experts": grouped_experts(a.n_experts, d, h), "shared_experts": shared},
                       init=(a,))


def block(a: ModelArgs) -> ModuleShape:
    """Pre-norm attention, then a pre-norm SwiGLU MLP (an `MoE` in a mixture-of-experts model)."""
    ff = moe(a) if a.is_moe else feed_forward(a.dim, a.ffn_dim)
    return ModuleShape("TransformerBlock", children={"attention_norm": rms_norm(a.dim, a.norm_eps),
                                                     "attention": attention(a), "ffn_norm": rms_norm(a.dim, a.norm_eps),
                                                     "feed_forward": ff}, init=(a,))


def lora_adapters(in_features: int, out_features: int, rank: int, dropout: float) -> dict[str, ModuleShape]:
    """A `LoRALinear`'s own children (its weight and bias are the base linear's): A (rank x in), B (out x rank)."""
    return {"lora_A": linear(in_features, rank), "lora_B": linear(rank, out_features),
            "lora_dropout": ModuleShape("Dropout", init=(dropout,)) if dropout > 0 else ModuleShape("Identity")}


def expert_lora(n_experts: int, in_features: int, out_features: int, rank: int) -> ModuleShape:
    """An `ExpertLoRA`: per-expert factors A (E, rank, in) and B (E, out, rank), stacked like the expert weights."""
    shapes = {"lora_A": (n_experts, rank, in_features), "lora_B": (n_experts, out_features, rank)}
    return ModuleShape("ExpertLoRA", children={k: ModuleShape("_Factor", {"weight": ParamShape(v)}, init=v)
                                               for k, v in shapes.items()})


class ModelShape(ModuleShape):
    """The whole model's description, with the contract methods the planner asks (same answers as the model's):
    tok_embeddings, layers ("0", "1", ...), norm, output (the embedding's weight with tie_embeddings). A family
    with other blocks subclasses it (`block`, `final_norm`, `model_kind`, `moe_kind` and the contract methods it
    changes)."""

    moe_kind = "MoE"  # the kind of its mixture-of-experts layers (`moe_layers`)

    def __init__(self, args: ModelArgs):
        emb = ModuleShape("Embedding", {"weight": ParamShape((args.vocab_size, args.dim))},
                          init=(args.vocab_size, args.dim, args.pad_token_id))
        output = ModuleShape("Linear", {"weight": emb.weight if args.tie_embeddings
                                        else ParamShape((args.vocab_size, args.dim))},
                             init=(args.dim, args.vocab_size, False))
        layers = ModuleShape("ModuleDict", children={str(i): self.block(args, i) for i in range(args.n_layers)})
        children = {"tok_embeddings": emb, "layers": layers, "norm": self.final_norm(args), "output": output}
        super().__init__(self.model_kind(args), children=children, init=(args,))
        self.args = args

    def block(self, args: ModelArgs, layer: int) -> ModuleShape:
        return block(args)

    def final_norm(self, args: ModelArgs) -> ModuleShape:
        return rms_norm(args.dim, args.norm_eps)

    def model_kind(self, args: ModelArgs) -> str:
        return "MoETransformer" if args.is_moe else "Llama"

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, str]:
        return tp_plan(self.args, sequence_parallel)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(tuple(f"layers.{k}" for k in self.layers.children), ("tok_embeddings",),
                              ("norm", "output"))

    def moe_layers(self) -> list[ModuleShape]:
        return [m for _, m in self.named_modules() if m.kind == self.moe_kind]

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.args, seq_len)

    def adapter_layout(self) -> AdapterLayout:
        return adapter_layout(self.args)


def _set_child(root: ModuleShape, name: str, mod: ModuleShape) -> None:
    parent, _, child = name.rpartition(".")
    owner = root.get_submodule(parent) if parent else root
    owner.children[child] = mod
    setattr(owner, child, mod)


def expert_lora_shape(experts: ModuleShape, role: str) -> tuple[int, int, int]:
    """(experts, in, out) of a per-expert adapter role on a grouped-experts description: stacked SwiGLU experts
    (`w1`, `w3`, `w2`), or experts stored as transformers' fused (E, dim, 2 x hidden) `gate_up_proj` and
    (E, hidden, dim) `down_proj` (GPT-OSS)."""
    if "w1" in experts.params:
        n, dim, hidden = experts.params["w1"].shape
        return (n, *expert_lora_dims(role, dim, hidden))
    n, dim, two_hidden = experts.params["gate_up_proj"].shape
    dims = {"experts.gate_up_proj": (dim, two_hidden), "experts.down_proj": (two_hidden // 2, dim)}
    if role not in dims:
        raise ValueError(f"peft: grouped experts have no adapter role {role!r} (only {', '.join(dims)})")
    return (n, *dims[role])


def expert_lora_dims(role: str, dim: int, hidden: int) -> tuple[int, int]:
    """(in, out) features of a per-expert adapter role on grouped experts (w1 and w3 fused as HF stores them)."""
    dims = {"experts.gate_up_proj": (dim, 2 * hidden), "experts.down_proj": (hidden, dim)}
    if role not in dims:
        raise ValueError(f"peft: grouped experts have no adapter role {role!r} (only {', '.join(dims)})")
    return dims[role]


def apply_lora(model: ModelShape, pcfg: Any) -> list[str]:
    """models/lora.py's `apply_lora` on the description: each targeted Linear becomes a LoRALinear (its base
    weight and bias, then lora_A (rank x in), lora_B (out x rank), lora_dropout), targeted grouped experts get
    per-expert factors under `adapters.<role>`, and the freeze policy sets `requires_grad` in the same order."""
    layout = layout_of(model)
    check_targets(model, pcfg)
    names = target_module_names(model, pcfg)
    r = pcfg.rank
    for name in names:
        base = model.get_submodule(name)
        if base.kind != "Linear":
            raise ValueError(f"peft: {name} is a {base.kind}, not a plain nn.Linear LoRA can adapt")
        out_f, in_f = base.params["weight"].shape
        _set_child(model, name, ModuleShape("LoRALinear", dict(base.params),
                                            lora_adapters(in_f, out_f, r, pcfg.dropout)))
    for role in resolve_roles(layout, list(pcfg.target_modules)):
        if role in layout.experts:
            for name, m in list(model.named_modules()):
                if name and pattern_matches(layout.experts[role], name):
                    n, in_f, out_f = expert_lora_shape(m, role)
                    _set_child(m, f"adapters.{role.rpartition('.')[2]}", expert_lora(n, in_f, out_f, r))
                    names.append(f"{name}.{role}")
    apply_freeze(model, layout, pcfg)
    return names


def apply_freeze(model, layout: AdapterLayout, pcfg) -> None:
    """The freeze policy, on a real model or its description: only adapters, plus the embeddings/norms the user
    took out of `peft.freeze`, keep requires_grad."""
    train = []
    if "embeddings" not in pcfg.freeze:
        train += list(layout.embeddings)
    if "norms" not in pcfg.freeze:
        train += list(layout.norms)
    trainable_modules = [n for n, _ in model.named_modules() if n and any(pattern_matches(p, n) for p in train)]
    for pname, p in model.named_parameters(remove_duplicate=False):
        p.requires_grad = is_adapter_param(pname) or pname.rpartition(".")[0] in trainable_modules


def adapter_layout(args: ModelArgs) -> AdapterLayout:
    """`Llama.adapter_layout` / `MoETransformer.adapter_layout`: the projections by their Hugging Face role names
    (LoRA's `target_modules`), embeddings, norms; MoE: attention projections as Llama's, the routed experts as
    grouped roles (per-expert adapters, HF's transformers 5 names), shared experts (if any) as linears; the
    router is not adapted."""
    dense = AdapterLayout(
        linears={"q_proj": "layers.*.attention.wq", "k_proj": "layers.*.attention.wk",
                 "v_proj": "layers.*.attention.wv", "o_proj": "layers.*.attention.wo",
                 "gate_proj": "layers.*.feed_forward.w1", "up_proj": "layers.*.feed_forward.w3",
                 "down_proj": "layers.*.feed_forward.w2"},
        embeddings=("tok_embeddings", "output"),
        norms=("layers.*.attention_norm", "layers.*.ffn_norm", "norm")
        + (("layers.*.attention.q_norm", "layers.*.attention.k_norm") if args.qk_norm else ()))
    if not args.is_moe:
        return dense
    linears = {k: v for k, v in dense.linears.items() if ".feed_forward." not in v}
    if args.n_shared_experts:
        linears.update({"shared_experts.gate_proj": "layers.*.feed_forward.shared_experts.w1",
                        "shared_experts.up_proj": "layers.*.feed_forward.shared_experts.w3",
                        "shared_experts.down_proj": "layers.*.feed_forward.shared_experts.w2"})
    experts = "layers.*.feed_forward.experts"
    return AdapterLayout(linears=linears, embeddings=dense.embeddings, norms=dense.norms,
                         experts={"experts.gate_up_proj": experts, "experts.down_proj": experts})


@functools.lru_cache(maxsize=1 << 16)  # a 70B model's ~1000 module names x a plan's patterns, checked often
def pattern_matches(pattern: str, name: str) -> bool:
    """A module-name pattern (the model contract's, TP plans', LoRA's): `*` matches one dotted component."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n, p))


def model_contract(model: Any):
    """The contract the plan reads: a built-in model's torch-free description answers it itself; an nn.Module
    through `contract_of`."""
    return model if isinstance(model, ModelShape) else contract_of(model)


def layout_of(model: Any) -> AdapterLayout:
    layout = model_contract(model).adapter_layout()
    if layout is None:
        raise ValueError(f"peft: {type(model).__name__} declares no adapter layout (which linear layers LoRA "
                         "may adapt): remove the peft section or use a dense Llama preset")
    return layout


def resolve_roles(layout: AdapterLayout, target_modules: list[str]) -> list[str]:
    """The roles `target_modules` names (in the layout's order: linears, then experts); ValueError naming a
    pattern that matches none."""
    roles = [*layout.linears, *layout.experts]
    for pat in target_modules:
        if not fnmatch.filter(roles, pat):
            raise ValueError(f"peft.target_modules: {pat!r} matches none of this model's linear layers "
                             f"({', '.join(roles)}); use those names or a pattern such as '*_proj'")
    return [r for r in roles if any(fnmatch.fnmatchcase(r, p) for p in target_modules)]


def check_targets(model: Any, pcfg: Any) -> None:
    """What `apply_lora` would refuse, without changing the model (ValueError, one line)."""
    layout = layout_of(model)
    experts = [r for r in resolve_roles(layout, list(pcfg.target_modules)) if r in layout.experts]
    if experts and pcfg.dropout > 0:
        raise ValueError(f"peft.dropout={pcfg.dropout} with expert adapters ({', '.join(experts)}): dropout cannot "
                         "be applied to a per-expert weight delta; set peft.dropout=0 or leave the experts out of "
                         "peft.target_modules")


def target_module_names(model: Any, pcfg: Any) -> list[str]:
    """Dotted names of the linear modules `pcfg.target_modules` selects, in module order."""
    layout = layout_of(model)
    patterns = [layout.linears[r] for r in resolve_roles(layout, list(pcfg.target_modules)) if r in layout.linears]
    return [n for n, _ in model.named_modules() if n and any(pattern_matches(p, n) for p in patterns)]



def describe(args: ModelArgs) -> ModelShape:
    """The built-in model `args` describes (not model.hf_model: that one is transformers' to build)."""
    if args.hf_model:
        raise ValueError("model.hf_model has no torch-free description: build it on the meta device")
    return ModelShape(args)


def tp_plan(args: ModelArgs, sequence_parallel: bool = False) -> dict[str, str]:
    plan = moe_tp_plan(sequence_parallel) if args.is_moe else dense_tp_plan(sequence_parallel)
    if args.qk_norm:  # the norms see this rank's heads only: their gradient is summed over tp
        plan.update({"layers.*.attention.q_norm": "head_norm", "layers.*.attention.k_norm": "head_norm"})
    return plan


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
    whole (EP splits those), so every tp rank computes them on the whole sequence. With sequence parallelism the MoE
    gathers the sequence in and re-shards its output (as Megatron gathers tokens around its experts), and the shared
    experts' row-wise projection returns the whole sequence, which the routed output is added to."""
    plan = {k: v for k, v in dense_tp_plan(sequence_parallel).items() if ".feed_forward." not in k}
    plan.update({"layers.*.feed_forward.shared_experts.w1": "colwise",
                 "layers.*.feed_forward.shared_experts.w3": "colwise",
                 "layers.*.feed_forward.shared_experts.w2": "rowwise_full" if sequence_parallel else "rowwise"})
    if sequence_parallel:
        plan["layers.*.feed_forward"] = "sequence_gather_scatter"
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
    return 6 * matmul + 3 * attention_forward_flops_per_token(a, seq_len)


def attention_forward_flops_per_token(a: ModelArgs, seq_len: int) -> float:
    """Scores and weighted sum, forward: 2 matmuls of S x S x head_dim per head and layer, 2*2*S*hd*H per token,
    halved by the causal mask; a layer with a sliding window shorter than S over the keys it sees
    (models/layer_types.py)."""
    windows = [window_of(a, i) for i in range(a.n_layers)]
    if all(w is None or w >= seq_len for w in windows):
        return a.n_layers * 2 * a.n_heads * a.hd * seq_len
    return sum(4 * a.n_heads * a.hd * keys_per_query(w, seq_len) for w in windows)
