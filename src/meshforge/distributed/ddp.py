"""`strategy: ddp`: torch DistributedDataParallel over the dp group, with the strategy's ddp options."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshforge.distributed.strategy import Strategy


class DDPStrategy(Strategy):
    def parallelize(self, model: nn.Module) -> nn.Module:
        # a meta-device model is wrapped once materialised: DDP broadcasts the parameters when it is made
        if not self.active or any(p.is_meta for p in model.parameters()):
            return model
        return self._wrap(model)

    def materialize(self, model: nn.Module, seed: int, init: bool = True) -> nn.Module:
        model = super().materialize(model, seed, init)
        if not self.active or isinstance(model, DistributedDataParallel):
            return model
        return self._wrap(model, values=init)

    def _wrap(self, model: nn.Module, values: bool = True) -> DistributedDataParallel:
        """DDP over the dp group. `values=False` (uninitialised parameters, the scale trace's fake tensors): no
        check or broadcast of values at construction, and the buckets all-reduced by `_allreduce_bucket` (the
        same collective from Python), because a fake process group completes the reducer's C++ future with no
        tensor, which the reducer asserts on."""
        o = self.options
        kwargs = {} if o.bucket_cap_mb is None else {"bucket_cap_mb": o.bucket_cap_mb}
        group = self.mesh_ctx.group("dp")
        ddp = DistributedDataParallel(
            model, process_group=group, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=bool(o.find_unused_parameters), static_graph=bool(o.static_graph),
            init_sync=values, **kwargs)
        if not values:
            ddp.register_comm_hook(group, _allreduce_bucket)
        return ddp

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


def _allreduce_bucket(group, bucket):  # no return annotation: DDP checks it, and annotations here are strings
    """DDP's default reduction of one bucket (mean over the group), run at once and handed back done."""
    buf = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(buf, group=group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut
