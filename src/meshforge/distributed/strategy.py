"""The protocol every data-parallel strategy implements, and the registry that maps YAML names to them.

The trainer only talks to this protocol, never to a strategy by name. Adding a
strategy is one module with a `Strategy` subclass and one `register` line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from meshforge.distributed.grad_norm import clip_grad_norm_

_REGISTRY: dict[str, Callable[..., Strategy]] = {}


def register(name: str):
    def deco(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def build_strategy(dcfg, mesh_ctx, device: torch.device) -> Strategy:
    import meshforge.distributed.ddp  # noqa: F401 - registration side effects
    import meshforge.distributed.fsdp2  # noqa: F401

    try:
        import meshforge.distributed.megatron_fsdp  # noqa: F401
    except ImportError:
        pass
    name = dcfg.strategy
    if name not in _REGISTRY:
        raise ValueError(f"distributed.strategy={name!r} is not available; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name](dcfg, mesh_ctx, device)


class Strategy:
    """Default behaviour: a plain single-process model (what world size 1 runs)."""

    name = "base"

    def __init__(self, dcfg, mesh_ctx, device: torch.device):
        self.dcfg, self.mesh_ctx, self.device = dcfg, mesh_ctx, device

    @property
    def active(self) -> bool:
        """False at world size 1 with nothing to shard: the model runs unwrapped."""
        return self.mesh_ctx.world_size > 1

    def parallelize(self, model: nn.Module) -> nn.Module:
        return model

    def optimizer_param_groups(self, model: nn.Module, weight_decay: float) -> list[dict]:
        """Weight decay on matrices, none on norms and biases (1-D), in parameter order."""
        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        # foreach optimizers cannot mix DTensor and plain parameters in one group (a partial TP plan has both)
        from torch.distributed.tensor import DTensor

        split = []
        for g in groups:
            dt = [p for p in g["params"] if isinstance(p, DTensor)]
            plain = [p for p in g["params"] if not isinstance(p, DTensor)]
            split += [{**g, "params": dt}, {**g, "params": plain}] if dt and plain else [g]
        return split

    @contextlib.contextmanager
    def micro_step(self, model: nn.Module, is_last: bool) -> Iterator[None]:
        """Around one micro-batch's forward+backward; strategies defer gradient sync until `is_last`."""
        yield

    def finish_grad_sync(self, model: nn.Module) -> None:
        """After the last backward of a step, before clipping: wait for outstanding reductions."""

    def clip_grad_norm_(self, model: nn.Module, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(list(model.parameters()), max_norm, self.mesh_ctx)

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Strategies with separate main and compute parameters copy the update back here."""

    def zero_grad(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def materialize(self, model: nn.Module, seed: int) -> None:
        """Allocate a meta-device model on the device and initialise it exactly like a full one would be."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        from meshforge.models import init_weights

        def copy(p, full):
            if isinstance(p, DTensor):
                local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(local.to_local())
            else:
                p.copy_(full.to(device=p.device, dtype=p.dtype))

        inner = self.unwrap(model)
        inner.to_empty(device=self.device)
        init_weights(inner, seed, copy_fn=copy)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module whose parameter names are the model's own (for checkpoints and init)."""
        return model
