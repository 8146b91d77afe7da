"""`strategy: fsdp2` (alias `fsdp`), as configuration and the planner see it: torch `fully_shard` per block, then
the root, over dp_shard*cp; HSDP replicates over dp_replicate. The runtime is `meshforge.distributed.fsdp2`.

What it keeps (the planner's terms, equal to what the bench measures): each parameter's local (TP) tensor sharded
on dim 0 over dp_shard*cp, padded to a multiple of it (parameters and gradients hold the padded shard; AdamW's
moments the unpadded torch.chunk piece); experts under EP: dim 0 over ep, dim 1 over ep_shard. Frozen parameters
(LoRA) only their shard. On CUDA (and under bf16_params) it gathers bf16; its fp32 shards are bf16_params' masters
when dp*cp > 1 (gradients accumulated unsharded and reduce-scattered in fp32); with nothing to shard (pipeline
stages alone) each stage is cast to bf16 and its optimizer keeps the masters. `offload_policy` moves the shards
and optimizer state to host memory (also per pipeline stage).
What it sends per step: every unit's parameters all-gathered per micro batch, again in backward for the units
resharded after forward (every block but the last by default, none under PP; `reshard_after_forward: true`: every
block, and the root unless the fused loss reads its head after forward, which keeps it gathered), gradients
reduce-scattered once (accumulation defers the reduction) and, under HSDP, all-reduced over dp_replicate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, field_validator

from meshforge.config.strategies import AXES, StrategyOptions, StrategySpec, StrictSection, dp_size, register_strategy
from meshforge.planning.layout import MeshAxis
from meshforge.planning.params import F32, STEP_BYTES, alike, chunk_rows, local_shape, memo, replicate_grad
from meshforge.planning.precision import bf16_params, fused_loss_on, gather_bytes
from meshforge.planning.terms import StrategyPlanTerms, replicas

if TYPE_CHECKING:
    from meshforge.config.schema import Config

DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


class MixedPrecisionConfig(StrictSection):
    """FSDP2 mixed precision; `None` = meshforge's default for the device (bf16/fp32 on CUDA, fp32 on CPU)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    param_dtype: DTypeName | None = None
    reduce_dtype: DTypeName | None = None
    output_dtype: DTypeName | None = None

    @field_validator("param_dtype", "reduce_dtype", "output_dtype", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


class FSDP2Options(StrategyOptions):
    mp_policy: MixedPrecisionConfig | None = None
    offload_policy: bool | None = None
    reshard_after_forward: bool | None = None  # None: every block but the last (no resharding under PP)
    defer_fsdp_grad_sync: bool | None = None  # None: true


# ------------------------------------------------------------------------------------------------ rules
def _hsdp_sizes(cfg: Config, world_size: int) -> list[str]:
    rep, dp = cfg.distributed.dp_replicate_size, dp_size(cfg, world_size)
    if rep is None or rep == 1 or dp is None or not (dp % rep or rep >= dp):
        return []
    return [f"distributed.dp_replicate_size={rep} must divide dp_size={dp} and be smaller than it "
            f"(pure replication is not sharding): choose a proper divisor of {dp}"]


def _cpu_offload(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if not d.options.offload_policy:
        return []
    out = []
    dp = dp_size(cfg, world_size)
    if world_size > 1 and dp is not None and dp * d.cp_size == 1:
        out.append(f"distributed.offload_policy=true offloads fsdp2's shards, but dp_size*cp_size=1 shards nothing "
                   f"(world size {world_size}: tp_size={d.tp_size}, pp_size={d.pp_size}): add data-parallel ranks "
                   "or turn offloading off")
    if d.ac_mode:
        out.append(f"distributed.offload_policy=true is not supported with activation_checkpointing="
                   f"{d.activation_checkpointing}: turn one of them off")
    return out


def _defer_under_pp(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if d.pp_size > 1 and d.options.defer_fsdp_grad_sync is False:
        return ["distributed.defer_fsdp_grad_sync=false has no effect with pp_size>1: the pipeline schedule "
                "reduces gradients once, after its last microbatch"]
    return []


def _bf16_params_dtype(cfg: Config, world_size: int) -> list[str]:
    mp = cfg.distributed.options.mp_policy
    if mp is not None and mp.param_dtype not in (None, "bfloat16"):
        return [f"training.precision=bf16_params contradicts distributed.mp_policy.param_dtype={mp.param_dtype}: "
                "remove one of them"]
    return []


# ------------------------------------------------------------------------------------------ planner terms
def _root_resharded(cfg: Config) -> bool:
    """The root (embedding, final norm, head) freed after forward and gathered again in backward: when asked,
    except under the fused loss, which reads the head's weight after forward (the runtime keeps the root)."""
    return bool(cfg.distributed.options.reshard_after_forward) and not fused_loss_on(cfg)


def _fsdp_units(group: list, layout, dim: int, n: int) -> tuple[dict, dict]:
    """({unit: padded elements}, {unit: padded trainable elements}) of FSDP's units (each block, the rest)
    sharded on `dim` over `n` ranks; memoised per parameter list (the search asks again for every candidate)."""
    def compute():
        units: dict = {}
        grads: dict = {}  # the trainable part of each unit: what its reduce-scatter carries
        for p in group:
            s = local_shape(p, layout)
            rest = math.prod(s) // s[dim] if s[dim] else 0
            padded = -(-s[dim] // n) * n * rest
            units[p.block] = units.get(p.block, 0) + padded
            grads[p.block] = grads.get(p.block, 0) + (padded if p.trainable else 0)
        return units, grads

    return memo("units", group, (layout.tp, layout.ep, dim, n), compute)


def _largest_block(stage, layout) -> int:
    def compute():
        sizes: dict = {}
        for p in stage:
            sizes[p.block] = sizes.get(p.block, 0) + math.prod(local_shape(p, layout))
        return max(sizes.values(), default=0)

    return memo("largest", stage, (layout.tp, layout.ep), compute)


class FSDP2Terms(StrategyPlanTerms):
    @staticmethod
    def _active(layout) -> bool:
        return layout.world_size > 1 and layout.size("dp_cp") > 1

    def state(self, stage, cfg, layout, c, out) -> None:
        active = self._active(layout)
        dense_n, dense_r = layout.dp_shard * layout.cp, c[MeshAxis.DP_SHARD_CP]
        ep_shard_n, ep_shard_r = layout.size(MeshAxis.EP_SHARD), c[MeshAxis.EP_SHARD]
        offload = bool(cfg.distributed.options.offload_policy)
        if not active and bf16_params(cfg):  # unsharded bf16 parameters, fp32 masters in the optimizer
            replicas(stage, layout, out, buckets=False, bf16=True)
            return
        for p, k in alike(stage):  # every block has the same parameters: each kind once, times its count
            s = local_shape(p, layout)
            full_grad = None
            if not active:
                stored = opt = math.prod(s)
                if replicate_grad(p):  # the vocabulary-parallel embedding's, whole on each tp rank
                    full_grad = math.prod(p.shape)
            else:
                dim, n, r = (1, ep_shard_n, ep_shard_r) if p.expert and layout.ep > 1 else (0, dense_n, dense_r)
                rest = math.prod(s) // s[dim] if s[dim] else 0
                stored = -(-s[dim] // n) * rest
                opt = chunk_rows(s[dim], n, r) * rest
            if not p.trainable:  # frozen: the (sharded) parameter only
                out.host += k * stored * F32 if offload else 0
                out.params += 0 if offload else k * stored * F32
                continue
            if offload:
                out.host += k * (2 * stored * F32 + 2 * opt * F32 + STEP_BYTES)
                continue
            out.params += k * stored * F32
            out.grads += k * (full_grad or stored) * F32
            out.optimizer += k * (2 * opt * F32 + STEP_BYTES)
        out.buffers = max(out.buffers, _largest_block(stage, layout) * gather_bytes(cfg))

    def comm(self, stage, cfg, layout, accum, add) -> None:
        if not self._active(layout):
            return
        reshard = cfg.distributed.options.reshard_after_forward
        dense = stage if layout.ep == 1 else [p for p in stage if not p.expert]
        experts = [p for p in stage if p.expert and layout.ep > 1]
        n, ne = layout.dp_shard * layout.cp, layout.size(MeshAxis.EP_SHARD)
        for group, nn_, dim in ((dense, n, 0), (experts, ne, 1)):
            if not group or nn_ == 1:
                continue
            units, grads = _fsdp_units(group, layout, dim, nn_)
            blocks = sorted(k for k in units if k is not None)
            regather = [b for b in blocks if (b != blocks[-1] if reshard is None else reshard)]
            if reshard is None and layout.pp > 1:
                regather = []
            total = sum(units.values())
            gathers = total + sum(units[b] for b in regather) + (units.get(None, 0) if _root_resharded(cfg) else 0)
            reps = accum if (layout.pp == 1) else 1
            ax = ("dp_shard_cp" if layout.cp > 1 else "dp_shard") if dim == 0 else "ep_shard"
            add(ax, "all_gather", gathers * reps * gather_bytes(cfg))
            add(ax, "reduce_scatter", sum(grads.values()) * F32)
            if dim == 0 and layout.dp_replicate > 1:
                add("dp_replicate", "all_reduce", sum(grads.values()) // nn_ * F32)

    def dtensor_grads(self, cfg, layout) -> bool:
        return self._active(layout)


SPEC = register_strategy(StrategySpec(
    name="fsdp2", runtime="meshforge.distributed.fsdp2:FSDP2Strategy", options=FSDP2Options, aliases=("fsdp",),
    description="torch fully_shard per block, then the root; HSDP on (dp_replicate, dp_shard)",
    composes_with=frozenset(AXES), shards_parameters=True, rules=(_hsdp_sizes, _cpu_offload),
    warnings=(_defer_under_pp,), plan=FSDP2Terms(), plan_search=True, frozen_params=True,
    bf16_params="fp32_shards", bf16_params_rule=_bf16_params_dtype,
    bridge_flags=("dist.use_torch_fsdp2",)))
