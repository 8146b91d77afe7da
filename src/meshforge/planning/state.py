"""Bytes of parameters, gradients and optimizer state one rank holds after a step (`rank_state`).

The planner's part is which parameters a rank holds: its pipeline stages' (each pipeline rank's stage lists come
from the pipeline plan; one list without PP). What a strategy keeps of them is the strategy's own knowledge, asked
of its spec's planner terms (`StrategySpec.plan`, see `planning/terms.py`): fsdp2's padded dim-0 shards, ddp's
replicas and reducer buckets, megatron_fsdp's flat buffers per unit. A strategy that declares no terms is counted
as full replicas (the plan notes it); frozen (LoRA) parameters are planned only under a strategy that says how it
keeps them, never silently counted as trainable.
"""

from __future__ import annotations

import dataclasses
import functools

from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import ParamRec, memo
from meshforge.planning.terms import DeclaredSharding, Parts, StrategyPlanTerms

UNDECLARED = DeclaredSharding()  # what a strategy without planner terms is counted as (full replicas)


def spec_of(cfg):
    """The configured strategy's spec; None when the name is not registered (the planner still plans replicas)."""
    try:
        return cfg.distributed.spec
    except ValueError:
        return None


def terms_of(cfg) -> StrategyPlanTerms:
    spec = spec_of(cfg)
    return spec.plan if spec is not None and spec.plan is not None else UNDECLARED


def stage_params(params: list[ParamRec], cfg, layout: Layout, pp_rank: int,
                 n_layers: int | None = None) -> list[list[ParamRec]]:
    """The parameters of each pipeline stage this pp rank holds (one list per stage; one list without PP)."""
    if layout.pp == 1:
        return [params]
    pplan = pipeline_plan_of(cfg, layout, n_layers)

    # what the lists depend on: each local stage's blocks and whether it is the first or the last (pipelines that
    # split alike share the lists, and what is memoised on them downstream)
    last = pplan.num_stages - 1
    here = tuple((tuple(pplan.stage_layers[s]), s == 0, s == last) for s in pplan.rank_stages(pp_rank))

    def compute():
        by = _by_place(params)
        stages = []
        for blocks, first, is_last in here:
            picked = [i for b in blocks for i in by.get(b, ())] + list(by.get("other", ()))
            picked += list(by.get("first", ())) if first else []
            picked += list(by.get("last", ())) if is_last else []
            stages.append([params[i] for i in sorted(set(picked))]  # in the model's order, as a filter keeps them
                          + ([tied_copy(p) for p in params if p.tied_copy] if is_last else []))
        return stages

    return memo("stages", params, here, compute)


def tied_copy(p: ParamRec) -> ParamRec:
    """The last stage's copy of a first-stage weight a last-stage module shares (distributed/pipeline_ties.py)."""
    return dataclasses.replace(p, name=p.tied_copy, place="last", tied_copy=None, copy=True)


def _by_place(params: list[ParamRec]) -> dict:
    """{block: indices of its parameters, "first"/"last"/"other": those of the model's ends} (memoised per list):
    a stage's parameters are gathered from its blocks' lists instead of filtering every parameter per stage."""
    def compute():
        out: dict = {}
        for i, p in enumerate(params):
            if p.block is not None:
                out.setdefault(p.block, []).append(i)
            if p.place in ("first", "last", "other"):
                out.setdefault(p.place, []).append(i)
        return out

    return memo("by_place", params, (), compute)


def pipeline_plan_of(cfg, layout: Layout, n_layers: int | None = None):
    pcfg = cfg.distributed.pipeline_or_default
    return _pipeline_plan(n_layers or _n_layers(cfg), layout.pp, pcfg.model_dump_json(exclude_unset=True),
                          cfg.training.global_batch_size // layout.dp)


@functools.lru_cache(maxsize=256)
def _pipeline_plan(n_layers: int, pp: int, pcfg_json: str, local_batch: int):
    from meshforge.config.schema import PipelineConfig
    from meshforge.planning.pipeline_plan import plan_pipeline

    return plan_pipeline(n_layers, pp, PipelineConfig.model_validate_json(pcfg_json), local_batch)


def _n_layers(cfg) -> int:
    from meshforge.models import resolve_model_args

    return resolve_model_args(cfg.model).n_layers


def _refuse_uncounted(params: list[ParamRec], cfg) -> None:
    """Frozen parameters are counted under the strategies that say how they keep them (their spec's
    `frozen_params` and planner terms); another strategy is one line, never a silently wrong plan."""
    from meshforge.config.strategies import either, strategy_specs
    from meshforge.errors import ConfigError

    if memo("all_trainable", params, (), lambda: all(p.trainable for p in params)):
        return
    spec = spec_of(cfg)
    if spec is None or spec.plan is None or not spec.frozen_params:
        able = [s.name for s in strategy_specs().values() if s.plan is not None and s.frozen_params]
        raise ConfigError(f"meshforge plan does not count frozen (LoRA) parameters under distributed.strategy="
                          f"{cfg.distributed.strategy}: plan with strategy {either(able)}")


def rank_state(params: list[ParamRec], cfg, layout: Layout, rank: int, n_layers: int | None = None) -> Parts:
    """Bytes of parameters, gradients and optimizer state global rank `rank` holds after a step (`n_layers`: the
    model's blocks when the caller knows them, saving their resolution)."""
    _refuse_uncounted(params, cfg)
    c = layout.coords(rank)
    terms = terms_of(cfg)
    out = Parts()
    for stage in stage_params(params, cfg, layout, c[MeshAxis.PP], n_layers):
        terms.state(stage, cfg, layout, c, out)
    return out


MOMENTS = ("head", "block", "end", "forward")


def rank_held(params: list[ParamRec], cfg, layout: Layout, rank: int, accum: int,
              n_layers: int | None = None) -> dict[str, int]:
    """{moment: bytes of parameters and gradients the strategy holds then} for global rank `rank` (its terms'
    `held`, over its pipeline stages); `accum`: micro batches per step without pipeline parallelism."""
    c = layout.coords(rank)
    terms = terms_of(cfg)
    stages = stage_params(params, cfg, layout, c[MeshAxis.PP], n_layers)
    out = {m: sum(terms.held(st, cfg, layout, c, m, accum, layout.pp > 1) for st in stages) for m in MOMENTS}
    if layout.pp > 1:  # the stages the schedule holds unsharded at once, the largest such set
        from meshforge.planning.activations import schedule_gathered_sets

        pplan = pipeline_plan_of(cfg, layout, n_layers)
        sizes = [terms.stage_gathered(st, cfg, layout) for st in stages]
        sets = schedule_gathered_sets(pplan.schedule, layout.pp, c[MeshAxis.PP], pplan.n_microbatches,
                                      pplan.stages_per_rank, len(stages))
        if getattr(cfg.distributed.options, "reshard_after_forward", None) is True:
            sets = [frozenset([i]) for i in range(len(stages))]  # freed after every forward: the running stage
        gathered = max(sum(sizes[i] for i in group) for group in sets)
        if len(stages) > 1:
            out["end"] = _stages_reduced(stages, terms, cfg, layout, c, accum, pplan, sizes)
        out["head"] += gathered
        out["block"] += gathered
    return out


def _stages_reduced(stages, terms, cfg, layout: Layout, c, accum: int, pplan, gathered: list[int]) -> int:
    """The "end" of a pipeline rank with several stages: torch reduces each stage after its own last backward
    (REDUCE_GRAD), one at a time; the stages reduced before it hold their state (sharded parameters and
    gradients), those still to come what they hold in backward (accumulated gradients; the next ones to run
    gathered, at most MAX_ACTIVE_STAGES at once)."""
    from meshforge.planning.activations import MAX_ACTIVE_STAGES, rank_passes

    passes = rank_passes(pplan.schedule, layout.pp, c[MeshAxis.PP], pplan.n_microbatches, pplan.stages_per_rank)
    last_b = {s: i for i, (op, s) in enumerate(passes or ()) if op == "B"}
    order = sorted(range(len(stages)), key=lambda s: last_b.get(s, -s))  # not replayed: the last stage first
    held = [{m: terms.held(st, cfg, layout, c, m, accum, True) for m in ("end", "head")} for st in stages]
    settled = []
    for st in stages:
        parts = Parts()
        terms.state(st, cfg, layout, c, parts)
        settled.append(parts.params + parts.grads)
    return max(held[s]["end"] + sum(settled[x] for x in order[:k]) + sum(held[x]["head"] for x in order[k + 1:])
               + sum(gathered[x] for x in order[k + 1:k + MAX_ACTIVE_STAGES]) for k, s in enumerate(order))
