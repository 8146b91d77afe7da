"""The runtime protocol every data-parallel strategy implements; the base class is what world size 1 runs.

A strategy's spec (`config/strategies/`: name, options, rules, checkpoint formats, planner terms) names its runtime
class, a subclass of `Strategy`; `build_strategy` imports it when a run starts. The trainer, the pipeline,
`parallelize`, expert parallelism, the checkpointer and the bench only talk to this protocol, never to a strategy by
name or class: what a strategy does with experts (`add_experts`), whether it gathers float8 weights itself
(`float8_all_gather`), what gradient memory it keeps beside `.grad` (`grad_buffer_bytes`) are its answers. The
state-dict methods default to torch's DCP helpers (`get_model_state_dict` and friends), which see through DDP and FSDP2;
a strategy with its own storage (megatron_fsdp's flat buffers) overrides them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from meshforge.distributed.grad_norm import clip_grad_norm_
from meshforge.errors import ConfigError
from meshforge.models import init_weights


def build_strategy(dcfg, mesh_ctx, device: torch.device) -> Strategy:
    """The runtime of the configured strategy (its spec names the class)."""
    spec = dcfg.spec
    cls = spec.runtime
    if isinstance(cls, str):
        module, _, name = cls.partition(":")
        cls = getattr(importlib.import_module(module), name)
    return cls(dcfg, mesh_ctx, device)


class Strategy:
    """Default behaviour: a plain single-process model (what world size 1 runs)."""

    def __init__(self, dcfg, mesh_ctx, device: torch.device):
        self.dcfg, self.options, self.mesh_ctx, self.device = dcfg, dcfg.options, mesh_ctx, device
        self.name = dcfg.strategy
        # training.precision=bf16_params: the dtype a sharding strategy gathers its fp32 shards in (fsdp2)
        self.param_dtype: torch.dtype | None = None
        # the fused loss reads the output head's weight after the model's forward (models.loss.HeadInput): the
        # unit holding it stays gathered until its backward
        self.head_read_after_forward = False

    @property
    def active(self) -> bool:
        """False at world size 1 with nothing to shard: the model runs unwrapped."""
        return self.mesh_ctx.world_size > 1

    # ------------------------------------------------------------------ wrapping
    def parallelize(self, model: nn.Module) -> nn.Module:
        return model

    @property
    def holds_masters(self) -> bool:
        """training.precision=bf16_params: the strategy keeps the fp32 master weights itself (fsdp2's fp32
        shards, megatron_fsdp's main buffers) and computes in `param_dtype`; otherwise the model is cast to bf16
        and the optimizer keeps the masters (`master_weights.py`)."""
        return False

    @property
    def float8_all_gather(self) -> bool:
        """training.fp8: the strategy all-gathers float8 weights itself (torchao's `enable_fsdp_float8_all_gather`
        for torch's fully_shard), so the cast happens before the gather."""
        return False

    def add_experts(self, experts: nn.Module) -> None:
        """Expert parallelism hands over each MoE layer's experts (already split over ep, dim 0 = expert); the
        strategy shards them over ep_shard when it wraps the model. Strategies that cannot say so."""
        raise ConfigError(f"distributed.strategy={self.name} cannot shard experts: use a strategy that composes "
                          "with ep")

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The module whose parameter names are the model's own (for checkpoints and init)."""
        return model

    # ------------------------------------------------------------------ one step
    def optimizer_param_groups(self, model: nn.Module, weight_decay: float) -> list[dict]:
        """Weight decay on matrices, none on norms and biases (1-D), in parameter order."""
        decay, no_decay = [], []
        for p in model.parameters():
            if p.requires_grad:
                (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        # foreach/fused optimizers cannot mix DTensor and plain parameters in one group (a partial TP plan has both)
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

    def materialize(self, model: nn.Module, seed: int, init: bool = True,
                    names: dict[str, str] | None = None) -> nn.Module:
        """Allocate a meta-device model on the device and initialise it exactly like a full one would be
        (`init=False`: allocate only, for a run whose values are never read: the scale trace's fake tensors;
        `names`: as `models.init_weights`). Returns the module to run: a strategy whose wrapper needs real
        parameters wraps here."""

        def copy(p, full):
            if isinstance(p, DTensor):
                local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(local.to_local())
            else:
                p.copy_(full.to(device=p.device, dtype=p.dtype))

        inner = self.unwrap(model)
        inner.to_empty(device=self.param_device)
        if init:
            init_weights(inner, seed, copy_fn=copy, names=names)
        if self.param_device != self.device:  # buffers compute on the device
            for m in inner.modules():
                for k, b in m._buffers.items():
                    if b is not None:
                        m._buffers[k] = b.to(self.device)
        return model

    @property
    def param_device(self) -> torch.device:
        """Where the parameters (this rank's shards) live at rest: the device, or the host when offloaded."""
        return self.device

    # ------------------------------------------------------------------ state dicts (DCP)
    def model_state_dict(self, model: nn.Module, full: bool = False) -> dict:
        """{name: tensor}: this rank's shards as DTensors (`full=False`, the fsdp_dtensor format), or plain full
        tensors gathered to rank 0's CPU (`full=True`, what torch_dist saves for a sharded strategy)."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def load_model_state_dict(self, model: nn.Module, state_dict: dict) -> None:
        set_model_state_dict(model, state_dict, options=StateDictOptions(strict=False))

    def optimizer_state_dict(self, models: list[nn.Module], optimizer: torch.optim.Optimizer,
                             full: bool = False) -> dict:
        target = models[0] if len(models) == 1 else models
        return get_optimizer_state_dict(target, optimizer,
                                        options=StateDictOptions(full_state_dict=full, cpu_offload=full))

    def load_optimizer_state_dict(self, models: list[nn.Module], optimizer: torch.optim.Optimizer,
                                  state_dict: dict) -> None:
        set_optimizer_state_dict(models[0] if len(models) == 1 else models, optimizer, state_dict)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter as a full tensor on every rank (parity checks, consolidated export); all ranks call."""
        # cpu_offload=True would leave every rank but 0 empty
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))

    # ------------------------------------------------------------------ accounting (the bench)
    def memory_report(self, optimizer: torch.optim.Optimizer) -> dict[str, int] | None:
        """Bytes of state per rank measured from the strategy's own storage (`params_at_rest`, `grads`,
        `optimizer_state`, ...), or None: the bench then counts the storages behind parameters, gradients and
        optimizer state itself."""
        return None

    def grad_buffer_bytes(self, model: nn.Module) -> int:
        """Bytes of gradient buffers the strategy keeps beside the parameters' `.grad` (e.g. a reducer's buckets),
        counted by the bench as gradient memory."""
        return 0

    def comm_bytes_total(self) -> int | None:
        """Bytes this strategy handed to collectives since its counter was reset, or None when it does not
        count (the bench's dispatch-level counter sees everything anyway)."""
        return None
