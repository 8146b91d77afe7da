"""`strategy: megatron_fsdp` (aliases `megatron-fsdp`, `mfsdp`), as configuration and the planner see it: flat
per-unit buffers, ZeRO 0-3 (`data_parallel_sharding_strategy`, or Megatron's `zero_dp_strategy` 0-3). The runtime
is `meshforge.distributed.megatron_fsdp`.

What it keeps (the planner's terms, equal to its buffers' `memory_report`): one flat buffer per unit (each block,
and everything else) padded to a multiple of dp*cp; trainable and frozen (LoRA) parameters of a unit in buffers
of their own, the frozen ones values only. no_shard / optim / optim_grads / optim_grads_params keep full or 1/N
parameters, gradients and moments; on CUDA a bf16 compute buffer beside the fp32 main one.
training.precision=bf16_params: the fp32 main buffers are the masters and the compute buffers bf16 on every
device (parameters gathered and computed in bf16); gradients accumulate and are reduced in fp32
(`grad_reduce_in_fp32`, which bf16_params requires), the optimizer steps the fp32 main shard.
What it sends per step: gradients all-reduced (no_shard, optim) or reduce-scattered; optim and optim_grads
all-gather the updated parameters, optim_grads_params gathers every unit per micro batch and again in backward
(all but the last block and the root); its sharded optimizer adds a 4-byte all-reduce of the norm.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import model_validator

from meshforge.config.strategies import StrategyOptions, StrategySpec, register_strategy
from meshforge.planning.layout import MeshAxis
from meshforge.planning.params import F32, STEP_BYTES, local_shape, memo
from meshforge.planning.precision import bf16_params, gather_bytes, on_cuda
from meshforge.planning.terms import Parts, StrategyPlanTerms

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class MegatronFSDPOptions(StrategyOptions):
    aliases: ClassVar[tuple[str, ...]] = ("zero_dp_strategy",)
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = None
    average_in_collective: bool | None = None
    grad_reduce_in_fp32: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    keep_fp8_transpose_cache: bool | None = None  # accepted; only meaningful with fp8 weights
    fsdp_unit_classes: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _zero_dp_strategy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "zero_dp_strategy" in data:  # Megatron spelling, 0-3
            data = dict(data)
            z = data.pop("zero_dp_strategy")
            if z is not None:
                if not (isinstance(z, int) and 0 <= z <= 3):
                    raise ValueError(f"zero_dp_strategy must be 0, 1, 2 or 3 (got {z!r})")
                data.setdefault("data_parallel_sharding_strategy", SHARDING_STRATEGIES[z])
        return data

    @property
    def sharding_strategy(self) -> str:
        return self.data_parallel_sharding_strategy or "optim_grads_params"


def _fp8_cache(cfg, world_size: int) -> list[str]:
    if cfg.distributed.options.keep_fp8_transpose_cache:
        return ["distributed.keep_fp8_transpose_cache only matters with fp8 weights; meshforge keeps weights in "
                "fp32/bf16 (training.fp8 casts them per matmul), so it has no effect"]
    return []


def _bf16_params_reduce(cfg, world_size: int) -> list[str]:
    if cfg.distributed.options.grad_reduce_in_fp32 is False:
        return ["training.precision=bf16_params keeps fp32 main gradients, but distributed.grad_reduce_in_fp32=false "
                "would accumulate and reduce them in bf16: remove grad_reduce_in_fp32 (or set it true)"]
    return []


# ------------------------------------------------------------------------------------------ planner terms
def _units(stage: list, layout) -> dict[tuple, list[int]]:
    """{(block, trainable): local element counts}: the flat buffers per unit, trainable and frozen parameters
    (LoRA) each in their own; memoised per parameter list (the search asks for every candidate)."""
    def compute():
        units: dict = {}
        for p in stage:
            units.setdefault((p.block, p.trainable), []).append(math.prod(local_shape(p, layout)))
        return units
    return memo("mfsdp", stage, (layout.tp, layout.ep), compute)


class MegatronFSDPTerms(StrategyPlanTerms):
    def state(self, stage, cfg, layout, c, out) -> None:
        mode = cfg.distributed.options.sharding_strategy
        world, rank = (layout.size("dp_cp"), c[MeshAxis.DP_CP]) if layout.world_size > 1 else (1, 0)
        compute_b = 2 if on_cuda(cfg) or bf16_params(cfg) else F32
        fp32_reduce = cfg.distributed.options.grad_reduce_in_fp32 is not False
        reduce_b = F32 if fp32_reduce else compute_b
        gathered: dict = {}  # a block's units are gathered together
        for (block, trainable), numels in _units(stage, layout).items():
            total = sum(numels)
            shard = -(-total // world) if total else 0
            padded = shard * world
            sharded = mode != "no_shard"
            lo, hi = (rank * shard, (rank + 1) * shard) if sharded else (0, padded)
            gathered[block] = gathered.get(block, 0) + padded * compute_b
            if mode == "optim_grads_params":  # the other modes keep every unit's parameters whole: nothing to gather
                out.buffers = max(out.buffers, gathered[block])
            if not trainable:  # values only, in the compute dtype: no main copy, gradients or optimizer state
                out.params += (shard if mode == "optim_grads_params" else padded) * compute_b
                continue
            # params at rest: main (+ compute when not sharded, + a compute shard in another dtype)
            main = (shard if sharded else padded) * F32
            if mode == "no_shard":
                out.params += padded * compute_b + (0 if compute_b == F32 else main)
            elif mode in ("optim", "optim_grads"):
                out.params += padded * compute_b + main
            else:
                out.params += main + (0 if compute_b == F32 else shard * compute_b)
            if mode in ("optim_grads", "optim_grads_params"):
                out.grads += shard * reduce_b + (0 if reduce_b == F32 else shard * F32)
            else:
                out.grads += padded * reduce_b + (0 if reduce_b == F32 else (hi - lo) * F32)
            off = 0
            for n in numels:
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    out.optimizer += 2 * (b - a) * F32 + STEP_BYTES
                off += n

    def held(self, stage, cfg, layout, c, moment, accum, pipelined) -> int:
        """What is alive beyond the state when the sharded modes (optim_grads, optim_grads_params) free a unit's
        full gradient buffer (reduce dtype, padded) once reduced (measured with the scale trace, Llama 3 8B
        widths, dp 4):
        - reductions overlapped (the default on CUDA): every trainable unit's buffer is alive at the end of
          backward, each freed only when the step's reductions are waited for. The last of that backward is the
          embedding's, whose weight gradient (compute dtype, the whole vocabulary x dim) exists beside them until
          its hook adds it to the unit's buffer (exact but for the embedding's activations);
        - not overlapped: each unit's buffer is freed at once when its gradients are complete, but the root's
          (embedding, final norm, head) is made when the head's or norm's gradient arrives, before the blocks',
          and lives to the embedding's: a block's backward has it beside the block's own buffer and, with
          optim_grads_params, the block gathered beside the gathered root (optim_grads keeps the parameters whole:
          nothing gathered); exact but for temporaries, 0.1%."""
        out = Parts()
        self.state(stage, cfg, layout, c, out)
        rest = out.params + out.grads + out.buffers
        o = cfg.distributed.options
        world = layout.size("dp_cp")
        if moment == "forward":
            return 0
        if o.sharding_strategy not in ("optim_grads", "optim_grads_params") or world == 1:
            return rest
        overlap = on_cuda(cfg) if o.overlap_grad_reduce is None else o.overlap_grad_reduce
        reduce_b = F32 if o.grad_reduce_in_fp32 is not False else (2 if on_cuda(cfg) else F32)
        compute_b = 2 if on_cuda(cfg) or bf16_params(cfg) else F32
        full, gathered = {}, {}  # {block: padded elements} of the trainable units, of all units
        for (block, trainable), n in _units(stage, layout).items():
            padded = -(-sum(n) // world) * world
            gathered[block] = gathered.get(block, 0) + padded
            if trainable:
                full[block] = full.get(block, 0) + padded
        if overlap:
            if moment != "end":
                return rest
            embedding = sum(math.prod(p.shape) for p in stage
                            if p.place == "first" and p.trainable and len(p.shape) == 2)
            return rest + sum(full.values()) * reduce_b + embedding * compute_b
        if moment != "block":
            return rest
        root_early = any(p.block is None and p.trainable and p.place == "last" for p in stage)
        root = full.get(None, 0) if root_early else 0
        # the block's and the (early) root's gradient buffers; optim_grads_params also gathers the block beside the
        # gathered root (beyond `buffers`), optim_grads keeps every unit's parameters whole
        gathers = o.sharding_strategy == "optim_grads_params"
        return rest + max(((root + full.get(b, 0)) * reduce_b + (max(
            0, (gathered.get(None, 0) + gathered[b]) * compute_b - out.buffers) if gathers else 0)
            for b in gathered if b is not None), default=0)

    def comm(self, stage, cfg, layout, accum, add, passes=None) -> None:
        dp_cp = layout.size("dp_cp")
        if dp_cp == 1:
            return
        mode, e_param = cfg.distributed.options.sharding_strategy, gather_bytes(cfg)
        units = {k: sum(v) for k, v in _units(stage, layout).items()}  # {(block, trainable): elements}
        pad = {k: -(-u // dp_cp) * dp_cp for k, u in units.items()}
        padded = sum(pad.values())
        train = sum(v for (_, tr), v in pad.items() if tr)  # only trainable units are reduced and re-gathered
        blocks = sorted({b for b, _ in units if b is not None})
        if mode in ("no_shard", "optim"):
            add("dp_cp", "all_reduce", train * F32)
        else:
            add("dp_cp", "reduce_scatter", train * F32)
        if mode in ("optim", "optim_grads"):
            add("dp_cp", "all_gather", train * e_param)
        if mode == "optim_grads_params":
            last = sum(v for (b, _), v in pad.items() if blocks and b == blocks[-1])
            root = sum(v for (b, _), v in pad.items() if b is None)
            add("dp_cp", "all_gather", (2 * padded - last - root) * accum * e_param)

    def norm_comm(self, cfg, layout, add) -> None:
        if layout.size("dp_cp") > 1 and cfg.distributed.options.sharding_strategy != "no_shard":
            add("dp_cp", "all_reduce", F32)  # the squared norms of its sharded optimizer's pieces

    def sharding(self, options: MegatronFSDPOptions) -> str | None:
        return options.sharding_strategy


SPEC = register_strategy(StrategySpec(
    name="megatron_fsdp", runtime="meshforge.distributed.megatron_fsdp:MegatronFSDPStrategy",
    options=MegatronFSDPOptions, aliases=("megatron-fsdp", "mfsdp"),
    description="Megatron-FSDP: flat per-unit buffers, ZeRO 0-3",
    composes_with=frozenset({"tp", "cp"}), ckpt_formats=("fsdp_dtensor",), shards_parameters=True,
    warnings=(_fp8_cache,), plan=MegatronFSDPTerms(), plan_search=True, frozen_params=True,
    bf16_params="main_buffers", bf16_params_rule=_bf16_params_reduce,
    flat_buffers=True, bridge_flags=("dist.use_megatron_fsdp", "ddp.use_megatron_fsdp"),
    bridge_refused=(("dist.use_tp_pp_dp_mapping", "is not supported with Megatron FSDP: set it false (meshforge "
                     "lays out ranks tp-innermost itself)"),),
    harness_flag="use_megatron_fsdp",
    harness_overrides=("distributed.data_parallel_sharding_strategy=optim_grads_params",
                       "distributed.average_in_collective=false", "distributed.keep_fp8_transpose_cache=false",
                       "checkpoint.resume=none")))
