"""FP8 training through torchao float8 (`training.fp8`): the blocks' linear layers become `Float8Linear`.

Weights stay in their own dtype (fp32 master, bf16 compute); each matmul casts its inputs to float8 with
dynamic scales, tensorwise (one scale per tensor) or rowwise (one per row, more accurate, slower). Under fsdp2
with tensorwise scaling the all-gather itself carries float8 weights (half the bytes of bf16), scaled from
the amax of the whole (all-reduced) weight, so every rank casts exactly as one process would.

Which linears convert: plain `nn.Linear`s only (a LoRA-adapted linear and LoRA's factors stay in high precision),
never the output head (its logits need the precision; the contract's `vocab_output`);
`filter: auto` keeps torchao's size heuristic (only matmuls large enough to gain on H100), `all` converts every
linear whose dimensions divide by 16 (a float8 matmul requirement). Converted before every parallelism,
activation checkpointing and compile wrap the blocks, and before the strategy (fsdp2's float8 all-gather
needs `Float8Linear` when `fully_shard` runs).

Under tensor parallelism (`float8_tp_styles`, after torchtitan): tensorwise-scaled linears take torchao's float8
styles, which cast each module's input (and its output's gradient) to float8 on the DTensor, so the amax and
the scale are the whole tensor's, as in one process. Under sequence parallelism the gathers stay in high
precision: the sub-layer's input is gathered by meshforge's own `sequence_gather` (which keeps only the shard for
backward), not by torchao's `PrepareFloat8ModuleInput` (a float8 gather), and the row-wise output's gradient is
gathered before its float8 cast (gloo cannot move float8 tensors; on NCCL that costs 2 bytes an element instead
of 1). Rowwise-scaled linears keep torch's styles (their per-row scales are computed on the DTensors inside
`Float8Linear`). A pipeline stage is converted
like a whole model (`pipeline.py` hands each stage the run's fp8 settings).
"""

from __future__ import annotations

import dataclasses
import fnmatch

import torch
from torch import nn

from meshforge.errors import ConfigError
from meshforge.models import contract_of
from meshforge.models.shapes import ADAPTER_PARTS


def float8_filter(model: nn.Module, filter_mode: str, recipe: str):
    """(module, fqn) -> convert?, with the model's vocabulary-parallel modules (head, embedding) excluded."""
    from torchao.float8 import _auto_filter_for_recipe

    plan = contract_of(model).tp_plan() or {}
    keep = [pattern for pattern, style in plan.items() if style in ("vocab_output", "vocab_embedding")]
    auto = _auto_filter_for_recipe(recipe, filter_fqns=[]) if filter_mode == "auto" else None

    def convert(module: nn.Module, fqn: str) -> bool:
        # plain linears only: torchao rebuilds the module as a Float8Linear, which would drop what a subclass adds
        # (a LoRA-adapted linear lost its adapters, and with them every trainable parameter, silently); nor LoRA's
        # factors (rank-wide matmuls gain nothing, and the planner counts them in high precision)
        if type(module) is not nn.Linear or fqn.rsplit(".", 1)[-1] in ADAPTER_PARTS:
            return False
        if any(fnmatch.fnmatchcase(fqn, p) for p in keep):
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


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def _tensorwise(module: nn.Module) -> bool:
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity == ScalingGranularity.TENSORWISE


def float8_tp_styles(model: nn.Module, resolved: dict[str, str], sequence_parallel: bool) -> dict:
    """{module name: torchao float8 style} for the tensorwise float8 linears of a resolved TP plan (colwise,
    rowwise); every other entry keeps its ordinary style."""
    if not any(_is_float8(m) for m in model.modules()):
        return {}
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

    def fp8(name: str) -> bool:
        m = model.get_submodule(name)
        return _is_float8(m) and _tensorwise(m)

    out: dict = {}
    for name, style in resolved.items():
        if style == "colwise" and fp8(name):
            out[name] = Float8ColwiseParallel()
        elif style == "rowwise" and fp8(name):
            out[name] = _float8_rowwise(sequence_parallel)
    return out


def _float8_rowwise(sequence_parallel: bool):
    """torchao's `Float8RowwiseParallel`; under sequence parallelism its output's gradient is cast to float8
    after the backward all-gather, not before (the same scale: the whole gradient's amax), so no collective
    moves float8 data (gloo cannot: `all_gather` of float8_e4m3fn fails with "Invalid scalar type")."""
    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic
    from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

    if not sequence_parallel:
        return Float8RowwiseParallel(output_layouts=Replicate())

    class Float8RowwiseSequenceParallel(Float8RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            outputs = NoopFwToFloat8BwDynamic.apply(outputs, mod.linear_mm_config,
                                                    mod.config.cast_config_grad_output.target_dtype)
            outputs = outputs.redistribute(placements=output_layouts, async_op=True)
            return outputs.to_local() if use_local_output else outputs

    return Float8RowwiseSequenceParallel(output_layouts=Shard(1))
