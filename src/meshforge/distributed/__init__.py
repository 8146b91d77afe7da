"""Distributed training: MeshContext, one module per strategy and per parallelism, and the order they apply in."""

from __future__ import annotations


def setup(dcfg, device: str = "auto"):
    from meshforge.distributed.parallelize import setup as _setup

    return _setup(dcfg, device)


def parallelize(model, mesh_ctx, dcfg, device=None):
    from meshforge.distributed.parallelize import parallelize as _parallelize

    return _parallelize(model, mesh_ctx, dcfg, device)


__all__ = ["parallelize", "setup"]
