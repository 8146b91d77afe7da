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
reduce-scattered once (accumulation defers the reduction; `defer_fsdp_grad_sync: false` reduces after every micro
batch) and, under HSDP, all-reduced over dp_replicate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, field_validator

from meshforge.config.strategies import AXES, StrategyOptions, StrategySpec, StrictSection, dp_size, register_strategy
from meshforge.planning.layout import MeshAxis
from meshforge.planning.params import (
    F32,
    STEP_BYTES,
    alike,
    blocks_alike,
    chunk_rows,
    local_shape,
    memo,
    replicate_grad,
)
from meshforge.planning.precision import (
    FLOAT8_AMAX,
    bf16_params,
    float8_gather,
    float8_weights,
    fused_loss_on,
    gather_bytes,
)
from meshforge.planning.terms import Parts, StrategyPlanTerms, replicas

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
def pipeline_gathers(passes: list[str], reshard: bool) -> int:
    """All-gathers of a pipeline stage's units per step, from its forwards (F), backwards (B) and the schedule's
    unshards (U) and reshards (R) (`planning.activations.lowered_passes`): anything finding the parameters freed
    gathers them; a forward frees them after it under `reshard_after_forward: true`, a backward keeps them
    (torch's schedule reshards after the last backward only)."""
    gathers, gathered = 0, False
    for op in passes:
        if op == "R":
            gathered = False
            continue
        gathers += not gathered
        gathered = not (op == "F" and reshard)
    return gathers


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
        of_kind: dict = {}  # each block signature's (padded, trainable padded) elements, computed once
        for block, sig, kinds in blocks_alike(group):
            if sig not in of_kind:
                padded = trained = 0
                for p, k in kinds:
                    s = local_shape(p, layout)
                    rest = math.prod(s) // s[dim] if s[dim] else 0
                    padded += k * -(-s[dim] // n) * n * rest
                    trained += k * -(-s[dim] // n) * n * rest if p.trainable else 0
                of_kind[sig] = padded, trained
            units[block], grads[block] = of_kind[sig]
        return units, grads

    return memo("units", group, (layout.tp, layout.ep, dim, n), compute)


def _last_trainable(group: list, layout, dim: int, n: int) -> dict:
    """{unit: padded elements of its last trainable parameter} (the order fully_shard reduces them in)."""
    def compute():
        out: dict = {}
        for p in group:
            if p.trainable:
                s = local_shape(p, layout)
                out[p.block] = -(-s[dim] // n) * n * (math.prod(s) // s[dim] if s[dim] else 0)
        return out

    return memo("last_trainable", group, (layout.tp, layout.ep, dim, n), compute)


def _float8_units(group: list, cfg, layout, dim: int, n: int) -> tuple[dict, dict]:
    """({unit: padded elements}, {unit: weights}) of the float8 linears' weights of FSDP's units (`_fsdp_units`):
    what fully_shard gathers in float8 when torchao casts before the gather (`precision.float8_gather`)."""
    f = cfg.training.fp8

    def compute():
        elems: dict = {}
        weights: dict = {}
        f8 = float8_weights(group, cfg)
        for p in group:
            if p.name in f8:
                s = local_shape(p, layout)
                elems[p.block] = elems.get(p.block, 0) + -(-s[dim] // n) * n * (math.prod(s) // s[dim])
                weights[p.block] = weights.get(p.block, 0) + 1
        return elems, weights

    return memo("float8_units", group, (layout.tp, layout.ep, dim, n, f.enabled, f.recipe, f.filter), compute)


def _per_gathers(per_unit: dict, cfg: Config, layout, per_step: tuple[int, int], regather: list) -> int:
    """`per_unit` (bytes or counts of each unit) summed over the all-gathers of one micro batch (under PP, of one
    step, `per_step`: a block's gathers and the root's): every unit once, the blocks in `regather` again in
    backward, the root again when it is resharded."""
    if layout.pp > 1:  # the stage's units, gathered once per step or as often as resharding makes it
        root = per_unit.get(None, 0)
        return (sum(per_unit.values()) - root) * per_step[0] + root * per_step[1]
    return (sum(per_unit.values()) + sum(per_unit.get(b, 0) for b in regather)
            + (per_unit.get(None, 0) if _root_resharded(cfg) else 0))


def _split_experts(stage: list, layout) -> tuple[list, list]:
    """(dense parameters, experts) of a stage: the experts are FSDP units of their own under EP only (else
    everything is dense); the same lists for the same stage (memoised), so the units memoised on them hit."""
    if layout.ep == 1:
        return stage, []
    return memo("experts", stage, (), lambda: ([p for p in stage if not p.expert], [p for p in stage if p.expert]))


def _replicated_embedding_grad(stage, layout) -> int:
    """Elements a vocabulary-parallel embedding's gradient has beyond its TP shard: it arrives Replicate, the whole
    (vocab x dim) on every tp rank, and is accumulated so (measured with the scale trace, torch 2.13)."""
    if layout.tp == 1:
        return 0
    return sum(k * (math.prod(p.shape) - math.prod(local_shape(p, layout))) for p, k in alike(stage)
               if p.place == "first" and p.tp_dim is not None and p.trainable)


def _root_last_grad(stage, layout) -> int:
    """Elements of the root unit's last trainable parameter's unsharded gradient: torch's `foreach_reduce` keeps it
    (a loop variable) beside the reduce-scatter input and output until the reduction returns (torch 2.13,
    measured with the scale trace: the head's, when untied). The unit's parameters are in module order."""
    last = [p for p in stage if p.block is None and p.trainable][-1:]
    return sum(math.prod(local_shape(p, layout)) for p in last) + _replicated_embedding_grad(last, layout)


def _largest_block(stage, layout) -> int:
    def compute():  # each block signature's size once
        sizes = {sig: sum(k * math.prod(local_shape(p, layout)) for p, k in kinds)
                 for _, sig, kinds in blocks_alike(stage)}
        return max(sizes.values(), default=0)

    return memo("largest", stage, (layout.tp, layout.ep), compute)


class FSDP2Terms(StrategyPlanTerms):
    @staticmethod
    def _active(layout) -> bool:
        return layout.world_size > 1 and layout.size("dp_cp") > 1

    def state(self, stage, cfg, layout, c, out) -> None:
        # what it depends on: the stage, the layout, this rank's shard coordinates and three settings (memoised:
        # a search and `held` ask again for the same stage and rank)
        offload, bf16, gb = bool(cfg.distributed.options.offload_policy), bf16_params(cfg), gather_bytes(cfg)
        dense_r, ep_shard_r = c[MeshAxis.DP_SHARD_CP], c[MeshAxis.EP_SHARD]
        mine = memo("fsdp2_state", stage, (layout, dense_r, ep_shard_r, offload, bf16, gb),
                    lambda: self._state(stage, layout, dense_r, ep_shard_r, offload, bf16, gb))
        out.params += mine.params
        out.grads += mine.grads
        out.optimizer += mine.optimizer
        out.host += mine.host
        out.buffers = max(out.buffers, mine.buffers)

    def _state(self, stage, layout, dense_r: int, ep_shard_r: int, offload: bool, bf16: bool, gb: int) -> Parts:
        out = Parts()
        active = self._active(layout)
        dense_n = layout.dp_shard * layout.cp
        ep_shard_n = layout.size(MeshAxis.EP_SHARD)
        if not active and bf16:  # unsharded bf16 parameters, fp32 masters in the optimizer
            replicas(stage, layout, out, buckets=False, bf16=True)
            return out
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
        out.buffers = max(out.buffers, _largest_block(stage, layout) * gb)
        return out

    def comm(self, stage, cfg, layout, accum, add, passes=None) -> None:
        if not self._active(layout):
            return
        reshard = cfg.distributed.options.reshard_after_forward
        per_step = pipeline_gathers(passes, reshard is True) if layout.pp > 1 and passes else 1
        dense, experts = _split_experts(stage, layout)
        n, ne = layout.dp_shard * layout.cp, layout.size(MeshAxis.EP_SHARD)
        for group, nn_, dim in ((dense, n, 0), (experts, ne, 1)):
            if not group or nn_ == 1:
                continue
            units, grads = _fsdp_units(group, layout, dim, nn_)
            blocks = sorted(k for k in units if k is not None)
            regather = [b for b in blocks if (b != blocks[-1] if reshard is None else reshard)]
            if dim == 1 and not cfg.distributed.moe_or_default.reshard_after_forward:
                regather = []  # the experts' units stay gathered from forward to backward
            # under PP the root as often as it is resharded: the last stage's not under the fused loss, which reads
            # its head after forward; the other stages' roots are resharded as asked
            kept = layout.pp > 1 and passes and reshard is True and not _root_resharded(cfg) and \
                any(p.place == "last" for p in group)
            root_per_step = pipeline_gathers(passes, False) if kept else per_step
            reps = accum if (layout.pp == 1) else 1
            counts = (per_step, root_per_step)
            gathers = _per_gathers(self._gathered_bytes(group, cfg, layout, dim, nn_), cfg, layout, counts, regather)
            # gradients are reduced once per step, or after every micro batch when the sync is not deferred
            reduces = reps if cfg.distributed.options.defer_fsdp_grad_sync is False else 1
            ax = ("dp_shard_cp" if layout.cp > 1 else "dp_shard") if dim == 0 else "ep_shard"
            add(ax, "all_gather", gathers * reps)
            if self._float8(cfg, layout):  # each float8 weight's amax, before each of its gathers
                f8 = _float8_units(group, cfg, layout, dim, nn_)[1]
                add(ax, "all_reduce", _per_gathers(f8, cfg, layout, counts, regather) * reps * FLOAT8_AMAX)
            add(ax, "reduce_scatter", sum(grads.values()) * F32 * reduces)
            if dim == 0 and layout.dp_replicate > 1:
                add("dp_replicate", "all_reduce", sum(grads.values()) // nn_ * F32 * reduces)

    def dtensor_grads(self, cfg, layout) -> bool:
        return self._active(layout)

    def _float8(self, cfg, layout) -> bool:
        """torchao casts the float8 linears' weights before fully_shard gathers them (the runtime's
        `float8_all_gather`: sharded, tensorwise scales, not under TP, whose scales must span the tp shards)."""
        return self._active(layout) and layout.tp == 1 and float8_gather(cfg)

    def _gathered_bytes(self, group, cfg, layout, dim: int, n: int) -> dict:
        """{unit: bytes of its all-gather output}: the gathered dtype, 1 byte an element of a float8 weight."""
        units, _ = _fsdp_units(group, layout, dim, n)
        gb = gather_bytes(cfg)
        f8 = _float8_units(group, cfg, layout, dim, n)[0] if self._float8(cfg, layout) else {}
        return {u: k * gb - f8.get(u, 0) * (gb - 1) for u, k in units.items()}

    def held(self, stage, cfg, layout, c, moment, accum, pipelined) -> int:
        """What fully_shard holds at `moment` (measured with the scale trace, meshforge.scale):
        - the sharded parameters always; the units gathered (bf16 on CUDA): the root (embedding, final norm,
          head: kept after forward) and the last block (not resharded after forward) at the loss's backward;
          every unit under pipeline parallelism (none is resharded: a stage's parameters stay gathered across
          the schedule), or with `reshard_after_forward: false`;
        - accumulated gradients: with gradient sync deferred over several micro batches (and always under
          pipeline parallelism, whose schedule reduces once, at its end) every unit keeps its unsharded
          gradient in the reduce dtype (fp32) from its first backward to the step's reduction; without
          deferring, the sharded gradients of the earlier micro batches;
        - at the end of backward the root's reduction: its unsharded gradients (compute dtype, or the
          accumulated fp32 ones) beside the fp32 reduce-scatter input.
        Memoised on what it reads (a search asks again for the same stage, rank and moment)."""
        o = cfg.distributed.options
        key = (layout, c[MeshAxis.DP_SHARD_CP], c[MeshAxis.EP_SHARD], accum, pipelined, bool(o.offload_policy),
               o.reshard_after_forward, o.defer_fsdp_grad_sync, cfg.distributed.moe_or_default.reshard_after_forward,
               bf16_params(cfg), gather_bytes(cfg), cfg.training.fp8.model_dump_json())
        return memo("fsdp2_held", stage, key, lambda: self._held(stage, cfg, layout, c, accum, pipelined))[moment]

    def _held(self, stage, cfg, layout, c, accum, pipelined) -> dict[str, int]:
        """{moment: bytes} of every moment at once (they share the units' sums)."""
        rest = Parts()
        self.state(stage, cfg, layout, c, rest)
        if not self._active(layout) or cfg.distributed.options.offload_policy:
            return dict.fromkeys(("head", "block", "end", "forward"), rest.params + rest.grads + rest.buffers)
        reshard = cfg.distributed.options.reshard_after_forward
        defer = cfg.distributed.options.defer_fsdp_grad_sync is not False
        accumulating = pipelined or (accum > 1 and defer)
        gathered, train, blocks, root_shard = {}, {}, set(), 0  # gathered: bytes of each unit's all-gather output
        for group, dim, n in self._groups(stage, layout):
            grads = _fsdp_units(group, layout, dim, n)[1]
            root_shard += grads.get(None, 0) // n
            for unit, nbytes in self._gathered_bytes(group, cfg, layout, dim, n).items():
                gathered[unit] = gathered.get(unit, 0) + nbytes
                train[unit] = train.get(unit, 0) + grads[unit]
                blocks.add(unit)
        gb = gather_bytes(cfg)
        ordered = sorted(b for b in blocks if b is not None)
        out = {}
        # the end, the root's reduction: its fp32 reduce-scatter input beside, first, its unsharded gradients (the
        # compute dtype, or the accumulated fp32 ones; its sharded gradient not made yet unless earlier micro
        # batches' reductions made it), then, once they are copied in, its last parameter's unsharded gradient
        # and the reduce-scatter output (the new sharded gradient, or a temporary added to the existing one)
        root, grad_b = train.get(None, 0), F32 if accumulating else gb
        shard_before = accum > 1 and not defer and not pipelined
        # HSDP keeps each unit's all-reduce buffer (its reduce-scatter output) to the end of backward: the blocks'
        # are temporaries beside their gradients when these were made by earlier micro batches
        kept_ar = rest.grads - root_shard * F32 if shard_before and layout.dp_replicate > 1 else 0
        copy_in = rest.params + rest.grads - (0 if shard_before else root_shard * F32) + root * grad_b + root * F32 \
            + kept_ar
        copied = rest.params + rest.grads + (root_shard * F32 if shard_before else 0) + root * F32 + \
            _root_last_grad(stage, layout) * grad_b + kept_ar
        out["end"] = max(copy_in, copied)
        if pipelined:  # the schedule's REDUCE_GRAD: the stage's units reduced one after another, the root first
            out["end"] = rest.params + self._pipelined_reduction(stage, layout, gb)
        if not pipelined:
            # a block's unshard in forward: the root kept, the all-gather output of the unit before it not yet freed
            # (fully_shard frees an all-gather's output at the next one), the block's own output and its copies
            # into the parameters
            big = max((gathered[b] for b in ordered), default=0)
            grads = sum(train.values()) * F32 if accumulating else (rest.grads if accum > 1 else 0)
            out["forward"] = rest.params + 2 * gathered.get(None, 0) + 2 * big + grads
        if pipelined:  # which stages are gathered at once is the schedule's (`stage_gathered`)
            kept = 0
        elif reshard is False:
            kept = sum(gathered.values())
        else:
            kept = gathered.get(None, 0) + (gathered[ordered[-1]] if ordered and reshard is None else 0)
            if not cfg.distributed.moe_or_default.reshard_after_forward:  # experts kept after forward
                kept += (sum(self._expert_units(stage, layout).values()) -
                         (self._expert_units(stage, layout).get(ordered[-1], 0) if ordered and reshard is None
                          else 0)) * gb
        grads = (sum(train.values()) + _replicated_embedding_grad(stage, layout)) * F32 if accumulating \
            else (rest.grads if accum > 1 else 0)
        out["head"] = out["block"] = rest.params + kept + grads  # a block's backward holds the same
        out.setdefault("forward", out["head"])  # under PP: no moment of its own (the head's value, as asked before)
        return out

    def stage_gathered(self, stage, cfg, layout) -> int:
        if not self._active(layout) or cfg.distributed.options.offload_policy:
            return 0
        return sum(sum(self._gathered_bytes(g, cfg, layout, d, n).values()) for g, d, n in self._groups(stage, layout))

    def _pipelined_reduction(self, stage, layout, gb: int) -> int:
        """Bytes beyond the sharded parameters at the worst moment of a pipeline stage's gradient reduction (torch's
        `perform_reduce_grad`, after the stage's last backward; measured with the scale trace, torch 2.13). It
        runs each unit's `post_backward` in the order of the stage's FSDP states, the root first, then each block
        (its dense unit, then its experts'): a unit reshards, then copies its unsharded fp32 gradients into the
        fp32 reduce-scatter input and allocates the output (its sharded gradient). `foreach_reduce`'s loop
        variable keeps the unit's last gradient alive beside both (the others are freed once copied); the units
        not reduced yet keep their unsharded fp32 gradients and stay gathered, the ones before hold their
        sharded gradients."""
        units = []  # (gathered elements, trainable elements, its last trainable parameter's, ranks), in order
        for group, dim, n in self._groups(stage, layout):
            gathered, train = _fsdp_units(group, layout, dim, n)
            last = _last_trainable(group, layout, dim, n)
            units += [(b, gathered[b], train[b], last.get(b, 0), n) for b in gathered]
        units.sort(key=lambda u: -1 if u[0] is None else u[0])  # stable: a block's dense unit before its experts
        worst, done = 0, 0
        pending = sum(t * F32 + g * gb for _, g, t, _, _ in units)
        for _, g, t, last, n in units:
            pending -= t * F32 + g * gb
            copy_in = t * F32 + t * F32  # every unsharded gradient and the reduce-scatter input
            # the output beside the input and the last gradient (a group of one rank keeps no loop variable)
            out_alloc = t * F32 + t // n * F32 + (last * F32 if n > 1 else 0)
            worst = max(worst, done + pending + max(copy_in, out_alloc))
            done += t // n * F32
        return worst

    @staticmethod
    def _expert_units(stage, layout) -> dict:
        """{block: padded expert elements} of the experts' own units (EP), {} without them."""
        experts = _split_experts(stage, layout)[1]
        if not experts or layout.ep == 1:
            return {}
        return _fsdp_units(experts, layout, 1, layout.size(MeshAxis.EP_SHARD))[0]

    @staticmethod
    def _groups(stage, layout):
        """(parameters, sharded dim, ranks) of the dense units and of the experts' units under EP."""
        dense, experts = _split_experts(stage, layout)
        out = [(dense, 0, layout.dp_shard * layout.cp)]
        if layout.ep > 1:
            out.append((experts, 1, layout.size(MeshAxis.EP_SHARD)))
        return [(g, d, n) for g, d, n in out if g]


SPEC = register_strategy(StrategySpec(
    name="fsdp2", runtime="meshforge.distributed.fsdp2:FSDP2Strategy", options=FSDP2Options, aliases=("fsdp",),
    description="torch fully_shard per block, then the root; HSDP on (dp_replicate, dp_shard)",
    composes_with=frozenset(AXES), shards_parameters=True, rules=(_hsdp_sizes, _cpu_offload),
    warnings=(_defer_under_pp,), plan=FSDP2Terms(), plan_search=True, frozen_params=True,
    bf16_params="fp32_shards", bf16_params_rule=_bf16_params_dtype,
    bridge_flags=("dist.use_torch_fsdp2",)))
