"""`strategy: ddp`: torch DistributedDataParallel over the dp group, with the strategy's ddp options.

training.precision=bf16_params (`distributed/master_weights.py`): the replicas are bf16, each rank's optimizer
keeps the fp32 masters and the micro batches' gradients accumulate in fp32 `main_grad`s; DDP's reducer would
all-reduce the bf16 gradients of every backward, so the model is not wrapped and `finish_grad_sync` averages the
fp32 main gradients over the dp group once per step, in buckets of `bucket_cap_mb` (Megatron's DDP with
`grad_reduce_in_fp32`). Every replica then steps its masters alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshforge.distributed.strategy import Strategy

_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb


class DDPStrategy(Strategy):
    @property
    def _fp32_main_grads(self) -> bool:
        """bf16_params over several ranks: this strategy all-reduces the fp32 main gradients itself."""
        return self.active and self.param_dtype is not None

    def parallelize(self, model: nn.Module) -> nn.Module:
        # a meta-device model is wrapped once materialised: DDP broadcasts the parameters when it is made
        if not self.active or self._fp32_main_grads or any(p.is_meta for p in model.parameters()):
            return model
        return self._wrap(model)

    def materialize(self, model: nn.Module, seed: int, init: bool = True,
                    names: dict[str, str] | None = None) -> nn.Module:
        model = super().materialize(model, seed, init, names)
        if not self.active or self._fp32_main_grads or isinstance(model, DistributedDataParallel):
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
        if isinstance(model, DistributedDataParallel) and not is_last and not self.options.static_graph:
            return model.no_sync()
        return contextlib.nullcontext()

    def finish_grad_sync(self, model: nn.Module) -> None:
        if self._fp32_main_grads:
            _average_main_grads(model, self.mesh_ctx.group("dp"), self.options.bucket_cap_mb or _BUCKET_MB)

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


@torch.no_grad()
def _average_main_grads(model: nn.Module, group, bucket_mb: float) -> None:
    """Average every trainable parameter's fp32 `main_grad` over `group`, a flat bucket at a time (parameter
    order: the same on every replica)."""
    grads = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            if getattr(p, "main_grad", None) is None:  # the same on every replica: the graph is the same
                raise RuntimeError(f"training.precision=bf16_params under ddp: parameter {name} got no gradient "
                                   "this step; every trainable parameter must take part in the loss")
            grads.append(p.main_grad)
    limit = max(1, int(bucket_mb * 2**20) // 4)
    bucket: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        bucket.append(g.view(-1))
        size = sum(t.numel() for t in bucket)
        if i == len(grads) - 1 or size + grads[i + 1].numel() > limit:
            flat = torch.cat(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
            torch._foreach_copy_(bucket, list(flat.split([t.numel() for t in bucket])))
            bucket = []
