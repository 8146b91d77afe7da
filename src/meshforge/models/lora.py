"""LoRA: low-rank adapters on a model's linear layers, the base weights frozen (no gradient, no optimizer state).

`apply_lora(model, peft_cfg)` swaps each targeted `nn.Linear` for a `LoRALinear` that keeps the *same* base
weight Parameter under the same name (`layers.0.attention.wq.weight`) and adds `lora_A` (rank x in) and
`lora_B` (out x rank) as child linears: `y = x W^T + (alpha / rank) * B(A(dropout(x)))`. Keeping the base
names means checkpoints, Hugging Face loading and FSDP wrapping see the model they know; the adapter names
(`...wq.lora_A.weight`) are the PEFT library's own, less its adapter-name level.

Targets are roles of the model contract's `adapter_layout()` (`q_proj`, `v_proj`, ...: the Hugging Face module
names PEFT users write), matched as fnmatch patterns (`*_proj`); a pattern matching no role is an error naming
it. Initialisation is a pure function of (seed, name) like every other parameter (`lora_init_spec`): A
normal(0, 1/rank) as PEFT's `init_lora_weights="gaussian"`, B zeros, so the adapted model starts as the base.
The freeze policy: every base parameter is frozen except the embeddings / norms the config lists as trainable.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.protocol import AdapterLayout, InitSpec, contract_of, set_submodule

ADAPTER_PARTS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """A frozen base linear (its own Parameter, shared, not copied) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        kw: dict[str, Any] = {"bias": False, "device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def is_adapter_param(name: str) -> bool:
    """True for a LoRA parameter name (`...wq.lora_A.weight`)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_PARTS


def lora_init_spec(name: str, shape: tuple[int, ...]) -> InitSpec | None:
    """A: normal(0, 1/rank); B: zeros (the adapted model starts equal to the base); None for other names."""
    if not is_adapter_param(name):
        return None
    return InitSpec("normal", 1.0 / shape[0]) if name.split(".")[-2] == "lora_A" else InitSpec("zeros")


def pattern_matches(pattern: str, name: str) -> bool:
    """A module-name pattern: `*` matches one dotted component."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n, p))


def layout_of(model: nn.Module) -> AdapterLayout:
    layout = contract_of(model).adapter_layout()
    if layout is None:
        raise ValueError(f"peft: {type(model).__name__} declares no adapter layout (which linear layers LoRA "
                         "may adapt): remove the peft section or use a dense Llama preset")
    return layout


def resolve_roles(layout: AdapterLayout, target_modules: list[str]) -> list[str]:
    """The roles `target_modules` names (in the layout's order); ValueError naming a pattern that matches none."""
    for pat in target_modules:
        if not fnmatch.filter(layout.linears, pat):
            raise ValueError(f"peft.target_modules: {pat!r} matches none of this model's linear layers "
                             f"({', '.join(layout.linears)}); use those names or a pattern such as '*_proj'")
    return [r for r in layout.linears if any(fnmatch.fnmatchcase(r, p) for p in target_modules)]


def target_module_names(model: nn.Module, pcfg: Any) -> list[str]:
    """Dotted names of the modules `pcfg.target_modules` selects, in module order."""
    layout = layout_of(model)
    patterns = [layout.linears[r] for r in resolve_roles(layout, list(pcfg.target_modules))]
    return [n for n, _ in model.named_modules() if n and any(pattern_matches(p, n) for p in patterns)]


def apply_lora(model: nn.Module, pcfg: Any) -> list[str]:
    """Adapt the targeted linears of `model` in place and apply the freeze policy; returns the adapted names.

    Works on a meta-device model too (the adapters are created where the base weight lives)."""
    layout = layout_of(model)
    names = target_module_names(model, pcfg)
    for name in names:
        base = model.get_submodule(name)
        if not isinstance(base, nn.Linear) or isinstance(base, LoRALinear):
            raise ValueError(f"peft: {name} is a {type(base).__name__}, not a plain nn.Linear LoRA can adapt")
        set_submodule(model, name, LoRALinear(base, pcfg.rank, pcfg.alpha, pcfg.dropout))
    train = []
    if "embeddings" not in pcfg.freeze:
        train += list(layout.embeddings)
    if "norms" not in pcfg.freeze:
        train += list(layout.norms)
    trainable_modules = [n for n, _ in model.named_modules() if n and any(pattern_matches(p, n) for p in train)]
    for pname, p in model.named_parameters(remove_duplicate=False):
        module = pname.rpartition(".")[0]
        p.requires_grad_(is_adapter_param(pname) or module in trainable_modules)
    return names


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{name: LoRALinear} of an adapted model, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += scaling * B A) and put the plain linear back."""
    for name, m in adapter_modules(model).items():
        m.weight += m.scaling * (m.lora_B.weight @ m.lora_A.weight).to(m.weight.dtype)
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        set_submodule(model, name, plain)
