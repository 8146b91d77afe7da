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

Grouped experts (an MoE layer's experts stacked in one 3-D weight) take per-expert adapters: the layout's
`experts` roles name the grouped module, which adds an `ExpertLoRA` per role (`add_lora`): A (E, rank, in) and B
(E, out, rank), stacked by expert like the weight so expert parallelism shards them with it, in PEFT's
convention for 3-D `target_parameters` (delta_e = scaling * B_e A_e in the (out, in) layout of the Hugging Face
expert weight). The module folds the deltas into its weights in forward (no dropout there: it cannot be
factored out of a weight delta, as in PEFT).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models import shapes
from meshforge.models.materialize import build, build_children, buildable
from meshforge.models.protocol import InitSpec, set_submodule
# torch-free (the planner reads them without torch): re-exported here
from meshforge.models.shapes import (  # noqa: F401
    ADAPTER_PARTS,
    apply_freeze,
    check_targets,
    is_adapter_param,
    layout_of,
    pattern_matches,
    resolve_roles,
    target_module_names,
)


class LoRALinear(nn.Linear):
    """A frozen base linear (its own Parameter, shared, not copied) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        # lora_A, lora_B, lora_dropout (models/shapes.py), next to the base weight
        for name, spec in shapes.lora_adapters(base.in_features, base.out_features, rank, dropout).items():
            self.add_module(name, build(spec, device=base.weight.device, dtype=base.weight.dtype))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


@buildable
class _Factor(nn.Module):
    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class ExpertLoRA(nn.Module):
    """Per-expert LoRA factors of one grouped weight: A (E, rank, in), B (E, out, rank); `delta` is (E, out, in)."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, rank: int, alpha: float,
                 like: torch.Tensor):
        super().__init__()
        build_children(self, shapes.expert_lora(n_experts, in_features, out_features, rank),  # lora_A, lora_B
                       device=like.device, dtype=like.dtype)
        self.scaling = alpha / rank

    def delta(self, local=lambda w: w) -> torch.Tensor:
        """scaling * B_e A_e for every (local) expert; `local` maps a stacked parameter to this rank's experts."""
        return torch.bmm(local(self.lora_B.weight), local(self.lora_A.weight)) * self.scaling


def lora_init_spec(name: str, shape: tuple[int, ...]) -> InitSpec | None:
    """A: normal(0, 1/rank); B: zeros (the adapted model starts equal to the base); None for other names."""
    if not is_adapter_param(name):
        return None
    return InitSpec("normal", 1.0 / shape[-2]) if name.split(".")[-2] == "lora_A" else InitSpec("zeros")


def apply_lora(model: nn.Module, pcfg: Any) -> list[str]:
    """Adapt the targeted linears of `model` in place and apply the freeze policy; returns the adapted names.

    Works on a meta-device model too (the adapters are created where the base weight lives)."""
    layout = layout_of(model)
    check_targets(model, pcfg)
    names = target_module_names(model, pcfg)
    for name in names:
        base = model.get_submodule(name)
        if not isinstance(base, nn.Linear) or isinstance(base, LoRALinear):
            raise ValueError(f"peft: {name} is a {type(base).__name__}, not a plain nn.Linear LoRA can adapt")
        set_submodule(model, name, LoRALinear(base, pcfg.rank, pcfg.alpha, pcfg.dropout))
    for role in resolve_roles(layout, list(pcfg.target_modules)):
        if role in layout.experts:
            for name, m in model.named_modules():
                if name and pattern_matches(layout.experts[role], name):
                    m.add_lora(role, pcfg.rank, pcfg.alpha)
                    names.append(f"{name}.{role}")
    apply_freeze(model, layout, pcfg)
    return names


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{name: LoRALinear} of an adapted model, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def expert_adapters(model: nn.Module) -> list[tuple[str, str, ExpertLoRA]]:
    """(grouped-experts module name, role, its ExpertLoRA) of an adapted model, in module and role order."""
    return [(n, role, m.lora(role)) for n, m in model.named_modules() for role in getattr(m, "lora_roles", ())]


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (W += scaling * B A) and put the plain linear back."""
    for name, m in adapter_modules(model).items():
        m.weight += m.scaling * (m.lora_B.weight @ m.lora_A.weight).to(m.weight.dtype)
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        set_submodule(model, name, plain)
    for m in list(model.modules()):
        if getattr(m, "lora_roles", None):
            m.merge_lora()
