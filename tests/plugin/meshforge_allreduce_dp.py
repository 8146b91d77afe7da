"""A data-parallel strategy from outside meshforge: this one module and one registration (the entry point in
the dist-info beside it, found when this folder is on PYTHONPATH) are all it takes for `meshforge validate`,
`train`, `verify` and `bench` to offer it (tests/parallel/test_verify.py, tests/parallel/test_bench_sweep.py).

`allreduce_dp`: plain replicas; after the last backward of a step the gradients are averaged over the data-
parallel group, flattened into buckets of at most `bucket_numel` elements, one all-reduce per bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field

from meshforge.config.strategies import StrategyOptions, StrategySpec
from meshforge.distributed.strategy import Strategy


class AllReduceOptions(StrategyOptions):
    bucket_numel: int = Field(1 << 20, gt=0)


class AllReduceStrategy(Strategy):
    def finish_grad_sync(self, model: torch.nn.Module) -> None:
        if not self.active:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        bucket: list[torch.Tensor] = []
        for g in grads + [None]:
            if g is not None and (not bucket or sum(b.numel() for b in bucket) + g.numel() <= self.options.bucket_numel):
                bucket.append(g)
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=self.mesh_ctx.group("dp"))
                flat.div_(self.mesh_ctx.dp_size)
                for b, piece in zip(bucket, flat.split([b.numel() for b in bucket])):
                    b.copy_(piece.view_as(b))
            bucket = [g] if g is not None else []


SPEC = StrategySpec(name="allreduce_dp", runtime=AllReduceStrategy, options=AllReduceOptions,
                    description="plain replicas, gradients all-reduced in buckets by hand",
                    ckpt_formats=("torch_dist",))
