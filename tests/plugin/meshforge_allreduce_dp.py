"""A data-parallel strategy from outside meshforge: this one module and one registration (the entry point in
the dist-info beside it, found when this folder is on PYTHONPATH) are all it takes for `meshforge validate`,
`train`, `verify`, `plan` and `bench` to offer it (tests/parallel/test_verify.py, tests/parallel/test_bench_sweep.py).

`allreduce_dp`: plain replicas; after the last backward of a step the gradients are averaged over the data-
parallel group, flattened into buckets of at most `bucket_numel` elements, one all-reduce per bucket. Its optimizer
state is sharded ZeRO-1 style: the parameters in the order of their names go round the dp ranks, each rank's
optimizer holds and updates only its own, and broadcasts them after the step. It tells the planner so in one
declaration (`DeclaredSharding(optimizer="owner")`, `meshforge.planning.terms`), and `meshforge plan` counts what
the bench measures (tests/parallel/test_bench_sweep.py). A checkpoint would hold one rank's optimizer state:
saving or loading one is refused in one line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import Field

from meshforge.config.strategies import StrategyOptions, StrategySpec
from meshforge.distributed.strategy import Strategy
from meshforge.errors import ConfigError
from meshforge.planning.terms import DeclaredSharding


class AllReduceOptions(StrategyOptions):
    bucket_numel: int = Field(1 << 20, gt=0)


class AllReduceStrategy(Strategy):
    def _owner(self, model: torch.nn.Module) -> dict[int, int]:
        """{id(parameter): the dp rank that updates it}: in the order of their names, round the ranks."""
        named = sorted(model.named_parameters(), key=lambda kv: kv[0])
        return {id(p): i % self.mesh_ctx.dp_size for i, (_, p) in enumerate(named)}

    def optimizer_param_groups(self, model: torch.nn.Module, weight_decay: float) -> list[dict]:
        groups = super().optimizer_param_groups(model, weight_decay)
        if not self.active:
            return groups
        owner, me = self._owner(model), self.mesh_ctx.dp_rank
        mine = [{**g, "params": [p for p in g["params"] if owner[id(p)] == me]} for g in groups]
        return [g for g in mine if g["params"]]

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

    def after_optimizer_step(self, model: torch.nn.Module) -> None:
        if not self.active:
            return
        group, owner = self.mesh_ctx.group("dp"), self._owner(model)
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, owner[id(p)]), group=group)

    def zero_grad(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for p in model.parameters():  # the gradients of the parameters other ranks update too
            p.grad = None

    def optimizer_state_dict(self, models, optimizer, full: bool = False) -> dict:
        raise ConfigError("distributed.strategy=allreduce_dp keeps each rank's optimizer state for its own "
                          "parameters and does not checkpoint it: set checkpoint.interval=0 and save_final=false")

    def load_optimizer_state_dict(self, models, optimizer, state_dict) -> None:
        self.optimizer_state_dict(models, optimizer)


SPEC = StrategySpec(name="allreduce_dp", runtime=AllReduceStrategy, options=AllReduceOptions,
                    description="plain replicas, gradients all-reduced in buckets by hand",
                    ckpt_formats=("torch_dist",), plan=DeclaredSharding(optimizer="owner"))
