"""What `meshforge plan` asks a data-parallel strategy: the terms its spec supplies (`StrategySpec.plan`).

The planner owns what every strategy shares (the parameters each pipeline stage holds, activations, TP/CP/EP/PP
traffic, the step time); a strategy's terms add what only it knows, in the bytes the bench measures
(`bench/measure.py`: storages behind parameters, gradients and optimizer state after a step; the full-buffer
side of each collective):

  state(stage, cfg, layout, coords, out)  parameters, gradients, optimizer state (and host memory, gathered
                                          buffers) that the rank at `coords` holds for one pipeline stage's
                                          parameters (`ParamRec`s), added to `out`
  comm(stage, cfg, layout, accum, add, passes)
                                          its data-parallel collectives of one optimizer step for that stage
                                          (`accum` micro batches per step; under PP `passes`, the stage's
                                          forwards "F" and backwards "B" in schedule order): add(axis, kind, bytes)
  dtensor_grads(cfg, layout)              gradients are DTensors sharded over the data-parallel mesh: clipping
                                          all-reduces 4 bytes per gradient and mesh dimension
  norm_comm(cfg, layout, add)             the gradient norm's collectives of its own
  held(stage, cfg, layout, coords, moment, accum, pipelined)
                                          parameters and gradients (sharded, gathered, accumulated, in
                                          reduction buffers) it holds at a moment of a step's last micro batch:
                                          "head" (the loss's backward, every activation alive), "block" (a
                                          block's backward), "end" (the last reductions) or "forward" (its
                                          gathers in forward; 0: no moment of its own); the peak is the largest
                                          (planning/plan.py). Default: what `state` holds after the step
  stage_gathered(stage, cfg, layout)      under PP, a stage's gathered parameters while the schedule keeps it
                                          unsharded (torch's multi-stage schedules: at most 3 stages at once)
  sharding(options)                       a mode the plan names beside the strategy, or None
  every_rank                              its bytes differ across data-parallel ranks beyond the first and last
                                          shard (a large world's plan then counts every rank)

`DeclaredSharding` is the declarative form: a strategy that can say in a few words where its state lives (ddp, a
plugin) declares it and gets the arithmetic; fsdp2 and megatron_fsdp compute theirs in their spec modules
(`config/strategies/`). A strategy that declares nothing is planned as full replicas, and the plan says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import F32, STEP_BYTES, ParamRec, chunk_rows, local_numel, local_shape, memo
from meshforge.planning.precision import bf16_params, gather_bytes

AddComm = Callable[[str, str, int], None]  # (mesh axis, collective kind, full-buffer bytes)


@dataclass
class Parts:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host: int = 0  # CPU-offloaded state (an offload policy)
    buffers: int = 0  # gathered/communication buffers in flight at the peak (largest unit, buckets)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class StrategyPlanTerms:
    """Base of every strategy's planner terms (see the module docstring); `state` and `comm` are its own.
    `every_rank`: its bytes differ between data-parallel ranks beyond the first and last shard (the plan then
    counts every rank of a large world, not those two)."""

    every_rank: bool = False

    def state(self, stage: list[ParamRec], cfg, layout: Layout, coords: dict[MeshAxis, int], out: Parts) -> None:
        raise NotImplementedError

    def comm(self, stage: list[ParamRec], cfg, layout: Layout, accum: int, add: AddComm,
             passes: list[str] | None = None) -> None:
        raise NotImplementedError

    def dtensor_grads(self, cfg, layout: Layout) -> bool:
        return False

    def held(self, stage: list[ParamRec], cfg, layout: Layout, coords: dict[MeshAxis, int], moment: str,
             accum: int, pipelined: bool) -> int:
        if moment == "forward":
            return 0
        out = Parts()
        self.state(stage, cfg, layout, coords, out)
        return out.params + out.grads + out.buffers

    def stage_gathered(self, stage: list[ParamRec], cfg, layout: Layout) -> int:
        """Bytes of a pipeline stage's parameters while the schedule holds the stage unsharded (beyond `held`)."""
        return 0

    def norm_comm(self, cfg, layout: Layout, add: AddComm) -> None:
        pass

    def sharding(self, options) -> str | None:
        return None


def replicas(stage: list[ParamRec], layout: Layout, out: Parts, buckets: bool, bf16: bool = False) -> None:
    """Full replicas; gradients, the reducer's buckets (counted as gradients) and optimizer state only for the
    trainable parameters. `bf16` (bf16_params, unsharded): bf16 parameters, fp32 main gradients, and the
    optimizer's fp32 master beside the moments (`distributed/master_weights.py`)."""
    train = [p for p in stage if p.trainable]
    n = sum(local_numel(p, layout) for p in stage)
    n_train = sum(local_numel(p, layout) for p in train)
    e = 2 if bf16 else F32
    out.params += n * e
    out.grads += n_train * F32 * (2 if buckets else 1)
    out.optimizer += (3 if bf16 else 2) * n_train * F32 + STEP_BYTES * len(train)


def dim0_shard(shape: list[int], dim: int, n: int, rank: int) -> tuple[int, int]:
    """(elements of the padded shard, elements of the unpadded torch.chunk piece) rank `rank` of `n` holds of a
    tensor of (local) `shape` split on `dim`: torch's fully_shard pads the shard it stores (parameters,
    gradients), while the optimizer's moments, made like the DTensor, hold the unpadded piece."""
    rest = math.prod(shape) // shape[dim] if shape[dim] else 0
    return -(-shape[dim] // n) * rest, chunk_rows(shape[dim], n, rank) * rest


Placement = Literal["replicated", "dim0", "owner"]


@dataclass(frozen=True)
class DeclaredSharding(StrategyPlanTerms):
    """Where a strategy keeps parameters, gradients and optimizer state, declared; over the ranks of `axis`:

      replicated  whole on every rank;
      dim0        each tensor split on dim 0, the shard padded to a multiple of the ranks as torch's
                  fully_shard pads it (the optimizer's moments take the unpadded torch.chunk piece);
      owner       (optimizer state only) whole tensors: the parameters in the order of their names, the i-th's on
                  rank i % ranks, ZeRO-1 style (that rank updates it and broadcasts it).

    Sharded parameters need sharded gradients and optimizer state, sharded gradients a sharded optimizer.
    `grad_buckets`: a second copy of the gradients (DDP's reducer buckets) when the group has several ranks.
    Collectives per step follow from the declaration: replicated gradients are all-reduced (dim0:
    reduce-scattered), dim0 parameters all-gathered once per micro batch, an owner-sharded optimizer broadcasts
    the updated parameters (dim0: all-gathers them); sharded gradients add one 4-byte all-reduce of the norm.
    """

    params: Placement = "replicated"
    grads: Placement = "replicated"
    optimizer: Placement = "replicated"
    axis: str = "dp"
    grad_buckets: bool = False

    def __post_init__(self) -> None:
        MeshAxis.parse(self.axis)
        ok = (self.params in ("replicated", "dim0") and self.grads in ("replicated", "dim0")
              and self.optimizer in ("replicated", "dim0", "owner")
              and (self.params == "replicated" or (self.grads == "dim0" and self.optimizer == "dim0"))
              and (self.grads == "replicated" or self.optimizer == "dim0"))
        if not ok:
            raise ValueError(f"DeclaredSharding(params={self.params}, grads={self.grads}, optimizer="
                             f"{self.optimizer}): sharded parameters need sharded gradients and optimizer state "
                             "(dim0), sharded gradients a dim0 optimizer; owner is for optimizer state only")

    @property
    def every_rank(self) -> bool:  # type: ignore[override]
        return self.optimizer == "owner"

    def _ranks(self, layout: Layout) -> int:
        return layout.size(self.axis) if layout.world_size > 1 else 1

    def state(self, stage, cfg, layout, coords, out) -> None:
        n = self._ranks(layout)
        if n == 1 or (self.params, self.grads, self.optimizer) == ("replicated",) * 3:
            # bf16_params on a "replicated" strategy (ddp): the fp32 main gradients are averaged without a reducer
            own_reduce = bf16_params(cfg) and cfg.distributed.spec.bf16_params == "replicated"
            replicas(stage, layout, out, buckets=self.grad_buckets and layout.dp * layout.cp > 1 and not own_reduce,
                     bf16=bf16_params(cfg))
            return
        r = coords[MeshAxis.parse(self.axis)]
        order = memo("by_name", stage, (), lambda: {name: i for i, name in enumerate(sorted(q.name for q in stage))})
        for p in stage:
            whole = local_numel(p, layout)
            shard, piece = dim0_shard(local_shape(p, layout), 0, n, r)
            out.params += (shard if self.params == "dim0" else whole) * F32
            if not p.trainable:
                continue
            out.grads += (shard if self.grads == "dim0" else whole) * F32 * (2 if self.grad_buckets else 1)
            owned = order[p.name] % n == r
            kept = {"replicated": whole, "dim0": piece, "owner": whole if owned else 0}[self.optimizer]
            out.optimizer += 2 * kept * F32 + STEP_BYTES if kept or self.optimizer == "dim0" else 0

    def comm(self, stage, cfg, layout, accum, add, passes=None) -> None:
        n = self._ranks(layout)
        if n == 1:
            return
        train = [p for p in stage if p.trainable]
        whole = sum(local_numel(p, layout) for p in train) * F32
        padded = sum(dim0_shard(local_shape(p, layout), 0, n, 0)[0] for p in train) * n * F32
        if self.grads == "replicated":
            add(self.axis, "all_reduce", whole)
        else:
            add(self.axis, "reduce_scatter", padded)
        if self.params == "dim0":
            gathered = sum(dim0_shard(local_shape(p, layout), 0, n, 0)[0] for p in stage) * n
            add(self.axis, "all_gather", gathered * accum * gather_bytes(cfg))
        elif self.optimizer == "owner":
            add(self.axis, "broadcast", whole)
        elif self.optimizer == "dim0":
            add(self.axis, "all_gather", padded)

    def norm_comm(self, cfg, layout, add) -> None:
        if self.grads != "replicated" and self._ranks(layout) > 1:
            add(self.axis, "all_reduce", F32)

    def held(self, stage, cfg, layout, coords, moment, accum, pipelined) -> int:
        """Replicated gradients appear in backward (set to None after every step): at the loss's backward only
        the earlier micro batches' (accumulated), all at the end; the reducer's buckets are there throughout."""
        out = Parts()
        self.state(stage, cfg, layout, coords, out)
        if moment == "forward":
            return 0  # nothing beyond the loss's backward: the plan takes the larger moment
        if self.grads != "replicated" or moment == "end" or accum > 1 or pipelined:
            return out.params + out.grads + out.buffers
        buckets = self.grad_buckets and self._ranks(layout) > 1 and layout.dp * layout.cp > 1
        return out.params + (out.grads // 2 if buckets else 0) + out.buffers
