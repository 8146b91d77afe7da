"""Build the parallel model a config describes: the one entry the trainer, the bench and the tests use.

Non-PP runs build one model; PP runs build this rank's stages (`pipeline.build_pipeline_model`). Large
models (or `model.init_device: meta`) are built on the meta device, parallelised, then materialised and
initialised from (seed, parameter name), so every layout starts from the same weights.
"""

from __future__ import annotations

import contextlib

import torch

from meshforge.distributed.master_weights import keep_masters
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.parallelize import parallelize_model, set_fused_loss
from meshforge.distributed.pipeline import build_pipeline_model
from meshforge.distributed.runtime import ParallelModel
from meshforge.errors import ConfigError
from meshforge.models import (
    blocks_of,
    build_model,
    init_weights,
    load_folder_weights,
    packing_problem,
    resolve_model_args,
)
from meshforge.models.lora import apply_lora


def use_meta_init(cfg, world_size: int, n_params: int) -> bool:
    if cfg.model.init_device != "auto":
        return cfg.model.init_device == "meta"
    if cfg.model.hf_model:
        return False  # built on CPU: its weights load before sharding, and buffers (e.g. RoPE's) get their values
    return world_size > 1 and n_params > 500_000_000


def build_parallel_model(cfg, mesh_ctx: MeshContext, device: torch.device, load_plain=None,
                         shape_only: contextlib.AbstractContextManager | None = None) -> ParallelModel:
    """Model on CPU or meta -> parallelised -> materialised and initialised identically at any world size.
    `load_plain(model)` (optional) writes weights into the plain, initialised model before any parallelism, on the
    CPU path only (not meta, not pipeline stages). `shape_only` (the scale trace's FakeTensorMode; needs the meta
    path): the meta model is materialised under it and left uninitialised, its values are never read."""
    try:
        meta_probe = build_model(cfg.model, device="meta")
    except ValueError as err:  # model.hf_model that transformers cannot build: one line
        raise ConfigError(str(err)) from None
    if not blocks_of(meta_probe, cfg.distributed.block_classes):  # FSDP units and activation checkpointing need them
        raise ConfigError(f"the model ({type(meta_probe).__name__}) declares no blocks (a transformers model: no "
                          "_no_split_modules): set distributed.block_classes to its layer class")
    n_params = sum(p.numel() for p in meta_probe.parameters())
    # the scale trace builds on meta (its fake tensors have no values: a model.hf_model's buffers need none either)
    meta = use_meta_init(cfg, mesh_ctx.world_size, n_params) or bool(shape_only is not None and cfg.model.hf_model)
    if shape_only is not None and not meta:
        raise ConfigError("a shape-only build (the scale trace) needs the meta-device path: set model.init_device=meta")
    if mesh_ctx.pp_size > 1:
        return build_pipeline_model(cfg, mesh_ctx, device, meta=meta, shape_only=shape_only)
    model = meta_probe if meta else build_model(cfg.model)
    if cfg.peft is not None:  # before init and wrapping: adapters initialise by name, strategies see them frozen
        apply_lora(model, cfg.peft)
    fused = set_fused_loss(model, cfg)
    if not meta:
        try:  # (a model.hf_model whose parameter has no seeded initialisation is refused here: one line)
            init_weights(model, cfg.run.seed)
            load_folder_weights(model)  # a model.hf_model folder's own weights
        except ValueError as err:
            raise ConfigError(str(err)) from None
        packing = any(s.packing for s in cfg.data.sources())  # (validation measured a smaller hf_model)
        problem = packing_problem(resolve_model_args(cfg.model), model) if packing else None
        if problem:
            raise ConfigError(problem)
        if load_plain is not None:
            load_plain(model)
        model.to(device)
    part = parallelize_model(model, mesh_ctx, cfg.distributed, device, compile=cfg.training.compile,
                             fp8=cfg.training.fp8, precision=cfg.training.precision,
                             compile_backend=cfg.training.compile_backend, fused_loss=fused)
    if meta:
        with shape_only or contextlib.nullcontext():
            part.model = part.strategy.materialize(part.model, cfg.run.seed, init=shape_only is None)
    keep_masters(part.model, part.strategy, cfg.training.precision)  # bf16_params: where the fp32 masters live
    return ParallelModel([part], mesh_ctx, device, cfg.training.precision)
