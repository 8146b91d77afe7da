"""Apply every parallelism to a model, in one fixed order: TP/SP -> CP -> EP -> activation checkpointing
-> compile -> data-parallel strategy.

Each parallelism is a small `apply_*` function in its own module that reads the
MeshContext; this file only decides the order. (Pipeline parallelism splits the
model into stages first and then calls `parallelize_model` on each stage.)
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.distributed.activation_checkpointing import apply_activation_checkpointing
from meshforge.distributed.blocks import find_blocks
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.strategy import Strategy, build_strategy


def parallelize_model(model: nn.Module, mesh_ctx: MeshContext, dcfg, device: torch.device | None = None,
                      compile: bool = False) -> tuple[nn.Module, Strategy]:
    device = device or torch.device("cpu")
    if mesh_ctx.tp_size > 1:
        from meshforge.distributed.tensor_parallel import apply_tp

        apply_tp(model, mesh_ctx, dcfg)
    if mesh_ctx.cp_size > 1:
        from meshforge.distributed.context_parallel import apply_cp

        apply_cp(model, mesh_ctx, dcfg)
        from meshforge.distributed.expert_parallel import share_moe_batch_stats

        share_moe_batch_stats(model, mesh_ctx)  # MoE aux loss over the whole micro batch (no-op for dense)
    if mesh_ctx.ep_size > 1:
        from meshforge.distributed.expert_parallel import apply_ep

        apply_ep(model, mesh_ctx, dcfg)
    apply_activation_checkpointing(find_blocks(model, dcfg.block_classes), dcfg.ac_mode)
    if compile:
        for block in find_blocks(model, dcfg.block_classes):
            block.compile()
    strategy = build_strategy(dcfg, mesh_ctx, device)
    model = strategy.parallelize(model)
    model._meshforge_strategy = strategy
    return model, strategy


def setup(dcfg, device: str = "auto") -> MeshContext:
    """Bring-your-own-model entry: init the process group (if launched by torchrun/SLURM) and build the meshes."""
    from meshforge.config.rules import check
    from meshforge.config.schema import Config
    from meshforge.distributed.env import init_distributed

    info = init_distributed(device, dcfg.timeout_minutes)
    problems = check(Config(distributed=dcfg), info.world_size)
    if problems:
        from meshforge.config.loader import ConfigError

        raise ConfigError(problems)
    return MeshContext.build(dcfg, info.world_size, info.rank, info.device.type)


def parallelize(model: nn.Module, mesh_ctx: MeshContext, dcfg, device: torch.device | None = None) -> nn.Module:
    """Bring-your-own-model entry: apply the configured parallelism to any nn.Module; returns the model."""
    if device is None:
        device = torch.device(mesh_ctx.device_type, torch.cuda.current_device()) \
            if mesh_ctx.device_type == "cuda" else torch.device("cpu")
    model, _ = parallelize_model(model.to(device), mesh_ctx, dcfg, device)
    return model
