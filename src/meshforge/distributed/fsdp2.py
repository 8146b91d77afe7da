"""`strategy: fsdp2`: torch `fully_shard` per block, then the root; HSDP on the 2-D (dp_replicate, dp_shard) mesh.

Sharding runs over `dp_shard_cp` (context-parallel ranks hold the same
parameters, so they shard them too). Defaults: mixed precision bf16 params with
fp32 reduction on CUDA, fp32 on CPU; reshard after forward for every block but
the last (its parameters are needed again at once by backward); gradient
reduce-scatter deferred to the last micro-batch of an accumulation.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from meshforge.distributed.blocks import find_blocks
from meshforge.distributed.strategy import Strategy, register

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, None: None}


@register("fsdp2")
class FSDP2Strategy(Strategy):
    @property
    def active(self) -> bool:
        return self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1

    def mp_policy(self, root: bool) -> MixedPrecisionPolicy:
        mp = self.dcfg.mp_policy
        cuda = self.device.type == "cuda"
        param = _DTYPES[mp.param_dtype] if mp and mp.param_dtype else (torch.bfloat16 if cuda else None)
        reduce = _DTYPES[mp.reduce_dtype] if mp and mp.reduce_dtype else (torch.float32 if cuda else None)
        output = _DTYPES[mp.output_dtype] if mp and mp.output_dtype else None
        # output_dtype only on the root: set on every block it breaks the next block's matmul (TORCH_NOTES)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output if root else None)

    def parallelize(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model
        d = self.dcfg
        mesh = self.mesh_ctx.dp_shard_mesh()
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if d.offload_policy \
            else OffloadPolicy()
        blocks = find_blocks(model, d.block_classes)
        for i, block in enumerate(blocks):
            reshard = d.reshard_after_forward if d.reshard_after_forward is not None else i < len(blocks) - 1
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=self.mp_policy(False),
                        offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=self.mp_policy(True), offload_policy=offload,
                    reshard_after_forward=d.reshard_after_forward if d.reshard_after_forward is not None else False)
        return model

    @contextlib.contextmanager
    def micro_step(self, model, is_last):
        if self.active and self.dcfg.defer_fsdp_grad_sync is not False:
            model.set_requires_gradient_sync(is_last)
        yield
