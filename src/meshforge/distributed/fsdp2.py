"""`strategy: fsdp2`: torch `fully_shard`; HSDP on the 2-D (dp_replicate, dp_shard) mesh. `apply_fsdp` decides every
wrapping in one place, as torchtitan's `apply_fsdp_to_decoder` does.

Sharding runs over `dp_shard_cp` (context-parallel ranks hold the same parameters, so they shard them too).
Defaults: mixed precision bf16 params with fp32 reduction on CUDA (and on CPU under training.precision=bf16_params),
fp32 on CPU; gradient reduce-scatter deferred to the last micro-batch of an accumulation.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshforge.distributed.env import policy_device_type
from meshforge.distributed.strategy import Strategy
from meshforge.models import blocks_of, contract_of, submodule_or_none

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


def apply_fsdp(model: nn.Module, strategy: FSDP2Strategy, experts: list[nn.Module]) -> nn.Module:
    """Every FSDP unit of `model`, in the order they must be made (a unit leaves alone the parameters an earlier
    one manages):

    1. routed experts (handed over by expert parallelism, already `Shard(0)` over ep): one unit per MoE layer over
       the ep_shard mesh, split on dim 1 (there may be more ep_shard ranks than local experts on dim 0), resharded
       after forward as `moe.reshard_after_forward` says. Done also when ep_shard has size 1: that keeps the dense
       units' hands off the expert parameters.
    2. `moe.wrap_outer_model: false` (with EP): the first-stage modules (embedding) and the last-stage ones (final
       norm, output head) one unit each over the dense mesh, gathered only around their own use; a tied
       embedding/head pair stays in the root unit.
    3. each block over the dense mesh (dp_shard_cp): resharded after forward except the last, whose parameters
       backward needs at once; none under pipeline parallelism (a stage's parameters stay gathered across
       micro batches); `reshard_after_forward` overrides both.
    4. the root: everything left (embedding, final norm, head), kept gathered after forward unless
       `reshard_after_forward` is true; kept under the fused loss whatever it says (the loss reads the head's
       weight after forward, and the root's backward, which runs first, would gather it again at once).
    """
    moe = strategy.dcfg.moe_or_default
    dense, reshard_moe = strategy.mesh_ctx.dp_shard_mesh(), bool(moe.reshard_after_forward)
    leaf = {"mp_policy": strategy.mp_policy(False), "offload_policy": strategy.offload()}
    for unit in experts:
        fully_shard(unit, mesh=strategy.mesh_ctx.mesh("ep_shard"), shard_placement_fn=lambda _p: Shard(1),
                    reshard_after_forward=reshard_moe, **leaf)
    if experts and not moe.wrap_outer_model:
        for group in _outer_groups(model):
            fully_shard(group, mesh=dense, reshard_after_forward=reshard_moe, **leaf)
    blocks = blocks_of(model, strategy.dcfg.block_classes)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dense, reshard_after_forward=strategy.reshard(i < len(blocks) - 1), **leaf)
    fully_shard(model, mesh=dense, mp_policy=strategy.mp_policy(True), offload_policy=leaf["offload_policy"],
                reshard_after_forward=strategy.reshard(False) and not strategy.head_read_after_forward)
    return model


def _outer_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The modules the model's pipeline layout gives the first stage and the last stage, as two groups; none when
    they share a parameter (tied embeddings) or the model declares no layout."""
    layout = contract_of(model).pipeline_layout()
    if layout is None:
        return []
    groups = [[m for m in (submodule_or_none(model, n) for n in names) if m is not None]
              for names in (layout.first_stage, layout.last_stage)]
    groups = [g for g in groups if g]
    first = {id(p) for m in groups[0] for p in m.parameters()} if groups else set()
    tied = len(groups) == 2 and any(id(p) in first for m in groups[1] for p in m.parameters())
    return [] if tied else groups


class FSDP2Strategy(Strategy):
    def __init__(self, dcfg, mesh_ctx, device: torch.device):
        super().__init__(dcfg, mesh_ctx, device)
        self.experts: list[nn.Module] = []  # handed over by expert parallelism, wrapped by `apply_fsdp`

    @property
    def active(self) -> bool:
        return self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1

    @property
    def holds_masters(self) -> bool:
        return self.active  # its fp32 shards, gathered in bf16

    @property
    def float8_all_gather(self) -> bool:
        # not under TP: torchao scales the float8 gather from the amax over the fsdp mesh only, so each tp shard
        # of a weight would get its own scale (measured: grad norm 1.1e-4 off one process at the first step, where
        # gathering the high-precision shards and casting the TP DTensor gives 1e-7)
        return self.active and self.mesh_ctx.tp_size == 1

    def mp_policy(self, root: bool) -> MixedPrecisionPolicy:
        mp = self.options.mp_policy
        cuda = policy_device_type(self.device) == "cuda"
        low = self.param_dtype or (torch.bfloat16 if cuda else None)  # bf16_params: bf16 on CPU too
        param = _DTYPES[mp.param_dtype] if mp and mp.param_dtype else low
        reduce = _DTYPES[mp.reduce_dtype] if mp and mp.reduce_dtype else (torch.float32 if low else None)
        output = _DTYPES[mp.output_dtype] if mp and mp.output_dtype else None
        # output_dtype only on the root: set on every block it breaks the next block's matmul (TORCH_NOTES)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output if root else None)

    def offload(self) -> OffloadPolicy:
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.options.offload_policy \
            else OffloadPolicy()

    @property
    def param_device(self) -> torch.device:
        # offloaded shards live on the host: fully_shard refuses them anywhere else at its lazy init ("FSDP
        # parameters should be materialized on CPU when enabling CPU offloading")
        return torch.device("cpu") if self.active and self.options.offload_policy else self.device

    def reshard(self, default: bool) -> bool:
        """`reshard_after_forward` when set, else `default`, and never under pipeline parallelism."""
        explicit = self.options.reshard_after_forward
        if explicit is not None:
            return explicit
        return default and self.mesh_ctx.pp_size == 1

    def add_experts(self, experts: nn.Module) -> None:
        self.experts.append(experts)

    def parallelize(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model
        return apply_fsdp(model, self, self.experts)

    @contextlib.contextmanager
    def micro_step(self, model, is_last):
        if self.active and self.options.defer_fsdp_grad_sync is not False:
            model.set_requires_gradient_sync(is_last)
        yield
