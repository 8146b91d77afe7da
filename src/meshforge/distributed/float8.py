"""FP8 training through torchao float8 (`training.fp8`): the blocks' linear layers become `Float8Linear`.

Weights stay in their own dtype (fp32 master, bf16 compute); each matmul casts its inputs to float8 with
dynamic scales, tensorwise (one scale per tensor) or rowwise (one per row, more accurate, slower). Under fsdp2
with tensorwise scaling the all-gather itself carries float8 weights (half the bytes of bf16), scaled from
the amax of the whole (all-reduced) weight, so every rank casts exactly as one process would.

Which linears convert: never the output head (its logits need the precision; the contract's `vocab_output`);
`filter: auto` keeps torchao's size heuristic (only matmuls large enough to gain on H100), `all` converts every
linear whose dimensions divide by 16 (a float8 matmul requirement). Converted before TP-free parallelisms,
activation checkpointing and compile wrap the blocks, and before the strategy (fsdp2's float8 all-gather
needs `Float8Linear` when `fully_shard` runs).
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from meshforge.errors import ConfigError
from meshforge.models import contract_of


def float8_filter(model: nn.Module, filter_mode: str, recipe: str):
    """(module, fqn) -> convert?, with the model's vocabulary-parallel modules (head, embedding) excluded."""
    from torchao.float8 import _auto_filter_for_recipe

    plan = contract_of(model).tp_plan() or {}
    keep = [pattern for pattern, style in plan.items() if style in ("vocab_output", "vocab_embedding")]
    auto = _auto_filter_for_recipe(recipe, filter_fqns=[]) if filter_mode == "auto" else None

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(fnmatch.fnmatchcase(fqn, p) for p in keep):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return auto is None or auto(module, fqn)

    return convert


def apply_float8(model: nn.Module, fp8cfg, device: torch.device, fsdp2_sharded: bool) -> int:
    """Convert in place; returns how many linears became float8 (0 is refused: the key would do nothing)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(f"training.fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
                          f"{torch.cuda.get_device_capability(device)}: set training.fp8.enabled=false")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError("training.fp8 needs torchao: pip install 'meshforge[fp8]'") from None
    config = Float8LinearConfig.from_recipe_name(fp8cfg.recipe)
    if fsdp2_sharded and fp8cfg.recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(model, fp8cfg.filter,
                                                                                    fp8cfg.recipe))
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if not converted:
        raise ConfigError(f"training.fp8: no linear layer of the model qualifies (filter={fp8cfg.filter}, "
                          f"{before} linears, dims must divide by 16): use training.fp8.filter=all or disable fp8")
    return converted
