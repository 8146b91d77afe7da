"""`strategy: fsdp2`: torch `fully_shard` per block, then the root; HSDP on the 2-D (dp_replicate, dp_shard) mesh.

Sharding runs over `dp_shard_cp` (context-parallel ranks hold the same
parameters, so they shard them too). Defaults: mixed precision bf16 params with
fp32 reduction on CUDA (and on CPU under training.precision=bf16_params), fp32 on CPU;
reshard after forward for every block but the last (its parameters are needed again at once by backward), and
for none under pipeline parallelism (a stage's parameters stay gathered across microbatches);
gradient reduce-scatter deferred to the last micro-batch of an accumulation.
Expert parallelism hands over each MoE layer's experts (`shard_experts`), which
are then sharded over ep_shard and left alone by the dense wrapping.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshforge.distributed.strategy import Strategy
from meshforge.models import blocks_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


class FSDP2Strategy(Strategy):
    @property
    def active(self) -> bool:
        return self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1

    def mp_policy(self, root: bool) -> MixedPrecisionPolicy:
        mp = self.options.mp_policy
        cuda = self.device.type == "cuda"
        low = self.param_dtype or (torch.bfloat16 if cuda else None)  # bf16_params: bf16 on CPU too
        param = _DTYPES[mp.param_dtype] if mp and mp.param_dtype else low
        reduce = _DTYPES[mp.reduce_dtype] if mp and mp.reduce_dtype else (torch.float32 if low else None)
        output = _DTYPES[mp.output_dtype] if mp and mp.output_dtype else None
        # output_dtype only on the root: set on every block it breaks the next block's matmul (TORCH_NOTES)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output if root else None)

    def _offload(self) -> OffloadPolicy:
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.options.offload_policy \
            else OffloadPolicy()

    def _reshard(self, default: bool) -> bool:
        explicit = self.options.reshard_after_forward
        if explicit is not None:
            return explicit
        return default and self.mesh_ctx.pp_size == 1

    def parallelize(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model
        mesh, offload = self.mesh_ctx.dp_shard_mesh(), self._offload()
        blocks = blocks_of(model, self.dcfg.block_classes)
        for i, block in enumerate(blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=self._reshard(i < len(blocks) - 1),
                        mp_policy=self.mp_policy(False), offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=self.mp_policy(True), offload_policy=offload,
                    reshard_after_forward=self._reshard(False))
        return model

    def shard_experts(self, experts: nn.Module, mesh, reshard_after_forward: bool) -> None:
        # dim 1: there may be more ep_shard ranks than local experts on dim 0
        fully_shard(experts, mesh=mesh, shard_placement_fn=lambda _p: Shard(1),
                    reshard_after_forward=reshard_after_forward, mp_policy=self.mp_policy(False),
                    offload_policy=self._offload())

    def shard_group(self, modules: list[nn.Module], reshard_after_forward: bool) -> None:
        fully_shard(modules, mesh=self.mesh_ctx.dp_shard_mesh(), reshard_after_forward=reshard_after_forward,
                    mp_policy=self.mp_policy(False), offload_policy=self._offload())

    @contextlib.contextmanager
    def micro_step(self, model, is_last):
        if self.active and self.options.defer_fsdp_grad_sync is not False:
            model.set_requires_gradient_sync(is_last)
        yield
