"""The seeded random start of a `model.hf_model` (models/hf_auto.py): transformers' own initialisation, made a
function of (seed, module name) so every rank and layout starts from the same weights.

transformers initialises a model by calling its `_init_weights(module)` on every module, children before their
parent (a parent may re-initialise a child's parameter, e.g. GPT-2's scaled residual projections, Qwen3-MoE's fused
experts and routers, Mamba's `A_log`); each call draws from the global RNG, so the values depend on how many
draws came before. `seeded_init` makes the same calls in the same order, reseeding a private RNG from
(seed, module name) before each: the distributions are exactly transformers', and a parameter's value depends
only on the seed and the names of the modules whose initialisation touches it.

A parameter no `_init_weights` call writes keeps the value its constructor gave it, if that value does not depend
on the RNG (checked by building the model twice under different seeds, e.g. Apertus' xIELU `alpha_p`); one the
constructor draws at random (e.g. OpenAI GPT's `Conv1D` weights) has no seeded equivalent and is refused in one
line naming it (give a folder with its weights).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn


def _module_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(("module:" + name).encode())) % (2**63)


def _visit(module: nn.Module, prefix: str, init: Callable[[nn.Module], None], seed: int, pretrained: type) -> None:
    """transformers' `initialize_weights` order (children first; a nested PreTrainedModel uses its own init)."""
    for name, child in module.named_children():
        child_init = child._init_weights if isinstance(child, pretrained) else init
        _visit(child, f"{prefix}{name}.", child_init, seed, pretrained)
    torch.default_generator.manual_seed(_module_seed(seed, prefix))  # CPU only: torch.manual_seed costs ms
    init(module)


@torch.no_grad()
def seeded_init(hf: nn.Module, seed: int, rebuild: Callable[[int], nn.Module], weights_follow: bool = False) -> None:
    """Initialise the plain (CPU, unsharded) transformers model `hf` in place, see the module docstring.
    `rebuild(rng_seed)` builds the same model again (only needed when a parameter is left to its constructor).
    `weights_follow`: a folder's weights replace every value next (each one or refused), so a parameter without
    a seeded initialisation is no reason to refuse."""
    from transformers import PreTrainedModel

    params = dict(hf.named_parameters())
    if any(p.is_meta for p in params.values()):
        raise ValueError("model.hf_model is initialised on CPU (it is never built on the meta device)")
    for p in params.values():
        p.fill_(float("nan"))  # what no initialisation call writes stays NaN
    with torch.random.fork_rng(devices=[]):
        _visit(hf, "", hf._init_weights, seed, PreTrainedModel)
    left = [n for n, p in params.items() if bool(torch.isnan(p).any())]
    if left and not weights_follow:
        _constructor_values(hf, left, rebuild)


def _constructor_values(hf: nn.Module, names: list[str], rebuild: Callable[[int], nn.Module]) -> None:
    """Parameters no `_init_weights` writes: the constructor's value when it is the same under any RNG state."""
    with torch.random.fork_rng(devices=[]):
        first, second = rebuild(0), rebuild(1)
    for name in names:
        a, b = first.get_parameter(name), second.get_parameter(name)
        if not torch.equal(a, b):
            raise ValueError(f"model.hf_model: parameter {name} ({type(hf).__name__}) is drawn at random by its "
                             "module's constructor, not by transformers' _init_weights, so it has no seeded "
                             "initialisation: give a folder with its weights (safetensors)")
        hf.get_parameter(name).copy_(a)
