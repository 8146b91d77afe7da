"""`strategy: ddp`, as configuration and the planner see it: torch DistributedDataParallel over the dp group.

Full replicas of parameters, gradients and optimizer state; its reducer's buckets hold a second copy of the
gradients, which one all-reduce per step (over the dp group) averages. Frozen parameters (LoRA) get no gradient
and no optimizer state. The runtime is `meshforge.distributed.ddp`.
training.precision=bf16_params: bf16 replicas (2 bytes a parameter), fp32 main gradients (4), fp32 masters and
moments in every rank's optimizer (12); the model is not wrapped in DDP (no reducer buckets): the strategy
averages the fp32 main gradients over dp once per step (the same bytes as fp32 DDP's all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from meshforge.config.strategies import StrategyOptions, StrategySpec, dp_size, register_strategy
from meshforge.planning.terms import DeclaredSharding

if TYPE_CHECKING:
    from meshforge.config.schema import Config


class DDPOptions(StrategyOptions):
    bucket_cap_mb: float | None = Field(None, gt=0)
    find_unused_parameters: bool | None = None
    static_graph: bool | None = None


def _static_graph_accumulation(cfg: Config, world_size: int) -> list[str]:
    t, dp = cfg.training, dp_size(cfg, world_size)
    if cfg.distributed.options.static_graph and dp and t.global_batch_size // (t.micro_batch_size * dp) > 1:
        return ["distributed.static_graph=true with gradient accumulation: DDP's static graph cannot skip a "
                "reduction, so gradients are all-reduced after every micro-batch (same result, more traffic)"]
    return []


def _bf16_params_reducer_keys(cfg: Config, world_size: int) -> list[str]:
    """Under bf16_params over several ranks there is no DDP reducer: its own keys would do nothing."""
    o = cfg.distributed.options
    if world_size == 1:
        return []
    return [f"distributed.{key}={str(v).lower()} is not read under training.precision=bf16_params (ddp averages the "
            f"fp32 main gradients itself, without DDP's reducer, and needs a gradient for every trainable "
            f"parameter): remove it" for key, v in (("find_unused_parameters", o.find_unused_parameters),
                                                      ("static_graph", o.static_graph)) if v is not None]


SPEC = register_strategy(StrategySpec(
    name="ddp", runtime="meshforge.distributed.ddp:DDPStrategy", options=DDPOptions,
    description="torch DistributedDataParallel: full replicas, gradients all-reduced",
    ckpt_formats=("torch_dist", "fsdp_dtensor"), warnings=(_static_graph_accumulation,),
    plan=DeclaredSharding(grad_buckets=True), frozen_params=True, bf16_params="replicated",
    bf16_params_rule=_bf16_params_reducer_keys))
