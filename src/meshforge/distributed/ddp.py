"""`strategy: ddp`: torch DistributedDataParallel over the dp group, with the strategy's ddp options."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshforge.distributed.strategy import Strategy


class DDPStrategy(Strategy):
    def parallelize(self, model: nn.Module) -> nn.Module:
        if not self.active:
            return model
        o = self.options
        kwargs = {} if o.bucket_cap_mb is None else {"bucket_cap_mb": o.bucket_cap_mb}
        return DistributedDataParallel(
            model, process_group=self.mesh_ctx.group("dp"),
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=bool(o.find_unused_parameters), static_graph=bool(o.static_graph), **kwargs)

    def micro_step(self, model, is_last):
        # static_graph DDP cannot skip a reduction (its reducer asserts), so it syncs every micro-batch;
        # the strategy's warnings say so when accumulation is on.
        if self.active and not is_last and not self.options.static_graph:
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model):
        return model.module if isinstance(model, DistributedDataParallel) else model

    def grad_buffer_bytes(self, model) -> int:
        """The reducer's buckets: a second copy of the gradients (none when the grads are views into them)."""
        if not isinstance(model, DistributedDataParallel):
            return 0
        data = model._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return 0  # grads are views into the buckets: already counted once
        sizes = str(data.get("bucket_sizes", "") or "")
        return sum(int(s) for s in sizes.replace(",", " ").split())
