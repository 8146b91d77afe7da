"""Apply every parallelism to a model, in one fixed order: (FP8 module swap) -> TP/SP -> CP -> EP ->
activation checkpointing -> compile -> data-parallel strategy.

Why this order: tensor parallelism turns parameters into DTensors that everything after it must see;
context parallelism swaps attention ops inside those blocks; expert parallelism splits the experts over ep
and hands them to the strategy (`add_experts`), which decides how they are sharded when it wraps the model;
activation checkpointing and compilation wrap whole blocks; the strategy comes last because it wraps (or
re-stores) the parameters all of the above produced. Nothing here knows which strategy runs: what differs is
the strategy's answer (`strategy.float8_all_gather`, `strategy.parallelize`).

Each parallelism is a small `apply_*` function in its own module that reads the MeshContext; this file
only decides the order and collects what the step needs into a `Parallelized`. (Pipeline parallelism
splits the model into stages first and then calls `parallelize_model` on each stage.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from meshforge.config.rules import check
from meshforge.config.schema import Config
from meshforge.distributed.activation_checkpointing import apply_activation_checkpointing
from meshforge.distributed.compile import apply_compile, compile_enabled
from meshforge.distributed.context_parallel import apply_cp
from meshforge.distributed.env import init_distributed
from meshforge.distributed.expert_parallel import apply_ep, share_moe_batch_stats
from meshforge.distributed.float8 import apply_float8
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.strategy import Strategy, build_strategy
from meshforge.distributed.tensor_parallel import apply_tp
from meshforge.errors import ConfigError
from meshforge.models import blocks_of, contract_of
from meshforge.planning.precision import fused_loss_on


@dataclass
class Parallelized:
    """A model after `parallelize_model`: the module to run, its strategy, and what the step needs."""

    model: nn.Module
    strategy: Strategy
    # (inputs, labels) -> (inputs, labels, positions) of this rank: context parallelism's sequence shard
    batch_transform: Callable | None = None
    # the context the loss (forward and backward) runs in: vocabulary-parallel loss under TP
    loss_context: Callable[[], AbstractContextManager] = field(default=contextlib.nullcontext)


def parallelize_model(model: nn.Module, mesh_ctx: MeshContext, dcfg, device: torch.device | None = None,
                      compile: bool | str = False, fp8=None, precision: str = "fp32",
                      compile_backend: str = "inductor", fused_loss: bool = False, stage: bool = False) -> Parallelized:
    """`stage`: a pipeline stage, which may hold no MoE layer under expert parallelism (an embedding-only first
    stage, DeepSeek-V3's dense first blocks)."""
    device = device or torch.device("cpu")
    strategy = build_strategy(dcfg, mesh_ctx, device)
    strategy.param_dtype = torch.bfloat16 if precision == "bf16_params" else None
    strategy.head_read_after_forward = fused_loss
    out = Parallelized(model, strategy)
    if fp8 is not None and fp8.enabled:  # module swap first: everything after wraps the float8 linears
        apply_float8(model, fp8, device, strategy.float8_all_gather)
    if mesh_ctx.tp_size > 1:
        out.loss_context = apply_tp(model, mesh_ctx, dcfg)
    if mesh_ctx.cp_size > 1:
        out.batch_transform = apply_cp(model, mesh_ctx, dcfg)
        share_moe_batch_stats(model, mesh_ctx)  # MoE aux loss over the whole micro batch (no-op for dense)
    if mesh_ctx.ep_size > 1:
        apply_ep(model, mesh_ctx, dcfg, strategy, required=not stage)
    blocks = blocks_of(model, dcfg.block_classes)
    apply_activation_checkpointing(blocks, dcfg.ac_mode)
    if compile_enabled(compile, device):
        apply_compile(blocks, compile_backend)
    out.model = strategy.parallelize(model)
    return out


def set_fused_loss(model: nn.Module, cfg) -> bool:
    """Turn the model's fused loss on where `training.fused_loss` asks (auto: where the layout allows); returns
    whether it is on. A model that cannot fuse is refused under an explicit true."""
    wanted = fused_loss_on(cfg)
    if not contract_of(model).set_fused_loss(wanted) and cfg.training.fused_loss is True:
        raise ConfigError(f"training.fused_loss=true: {type(model).__name__} returns logits and cannot hand the "
                          "loss its output head; set training.fused_loss=auto or false")
    return wanted


def setup(dcfg, device: str = "auto") -> MeshContext:
    """Bring-your-own-model entry: init the process group (if launched by torchrun/SLURM) and build the meshes."""
    info = init_distributed(device, dcfg.timeout_minutes)
    problems = check(Config(distributed=dcfg), info.world_size)
    if problems:
        raise ConfigError(problems)
    return MeshContext.build(dcfg, info.world_size, info.rank, info.device.type)


def parallelize(model: nn.Module, mesh_ctx: MeshContext, dcfg, device: torch.device | None = None) -> nn.Module:
    """Bring-your-own-model entry: apply the configured parallelism to any nn.Module; returns the model."""
    if device is None:
        device = torch.device(mesh_ctx.device_type, torch.cuda.current_device()) \
            if mesh_ctx.device_type == "cuda" else torch.device("cpu")
    return parallelize_model(model.to(device), mesh_ctx, dcfg, device).model
