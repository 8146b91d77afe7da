"""`meshforge plan --fit`: search layouts (tp, pp, cp, strategy, activation checkpointing, micro batch) for a
world size and device; the fastest that fit memory and pass the config rules come first. The strategies searched
are those whose spec offers itself (`plan_search`), with the parallelisms each composes with.

The model description is built once and shared by every candidate, and the config rules (the slow part: they
check the TP plan on a meta model) run only on the fastest candidates that fit, until `top` pass, so a 70B
model at 1024 ranks is searched in about a second.
"""

from __future__ import annotations

import itertools

from meshforge.planning.params import model_params
from meshforge.planning.plan import plan


def _candidates(cfg, world_size: int, args, gpus_per_node: int):
    from meshforge.config.strategies import strategy_specs

    specs = [s for s in strategy_specs().values() if s.plan_search]  # the strategies whose specs offer themselves
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node and args.n_heads % t == 0 and args.n_kv_heads % t == 0]
    pps = [p for p in (1, 2, 4, 8, 16) if args.n_layers % p == 0]
    for tp, pp, cp, spec, ac, mbs in itertools.product(tps, pps, (1, 2, 4, 8), specs, (False, "selective", "full"),
                                                      (1, 2, 4)):
        axes = {"tp": tp > 1, "sp": tp > 1, "pp": pp > 1, "cp": cp > 1}
        if world_size % (tp * pp * cp) == 0 and all(a in spec.composes_with for a, used in axes.items() if used):
            yield tp, pp, cp, spec.name, ac, mbs


def _configure(cfg, args, tp, pp, cp, strategy, ac, mbs):
    from meshforge.config.schema import PipelineConfig

    # copies of the two sections a candidate changes; the rest (model, data, ...) is shared, never written
    c = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(deep=True),
                               "training": cfg.training.model_copy()})
    d = c.distributed
    d.strategy = strategy  # ValueError when the config carries options of another strategy
    d.tp_size, d.pp_size, d.cp_size, d.dp_size, d.dp_replicate_size = tp, pp, cp, None, None
    d.activation_checkpointing = ac
    d.sequence_parallel = tp > 1
    c.training.micro_batch_size = mbs
    if pp > 1:
        d.pipeline = (PipelineConfig(pp_schedule="interleaved_1f1b", pp_microbatch_size=mbs, virtual_stages_per_rank=2)
                      if args.n_layers >= 2 * pp else PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=mbs))
    return c


def search(cfg, world_size: int, device, gpus_per_node: int = 8, mfu: float | None = None, top: int = 5,
           efficiency=None):
    """([(choice, Plan)] that fit and pass the rules, fastest first, at most `top`; [(choice, why)] rejected;
    the number of fitting candidates slower than those shown, whose rules were not checked)."""
    from meshforge.config.rules import check

    tp_cfg = cfg.model_copy(deep=True)
    tp_cfg.distributed.tp_size = 2  # resolve the TP plan's sharded dims once; tp 1 ignores them
    params, args = model_params(tp_cfg)
    gbs = cfg.training.global_batch_size
    fitting, rejected, cache = [], [], {}
    for tp, pp, cp, strategy, ac, mbs in _candidates(cfg, world_size, args, gpus_per_node):
        dp = world_size // (tp * pp * cp)
        choice = f"{strategy} tp{tp} pp{pp} cp{cp} dp{dp} ac={ac or 'none'} mbs={mbs}"
        if gbs % dp or (gbs // dp) % mbs:
            rejected.append((choice, f"global_batch_size {gbs} does not split into dp {dp} x micro batch {mbs}"))
            continue
        try:
            c = _configure(cfg, args, tp, pp, cp, strategy, ac, mbs)
            p = plan(c, world_size, device, gpus_per_node, mfu, params=params, args=args, state_cache=cache,
                     efficiency=efficiency)
        except Exception as err:  # noqa: BLE001 - a layout the config or planner refuses is a rejected layout
            problems = getattr(err, "problems", None) or [str(err)]
            rejected.append((choice, problems[0].split(":")[0]))
            continue
        if not p.fits:
            rejected.append((choice, "peak memory exceeds the device"))
            continue
        fitting.append((choice, c, p))
    fitting.sort(key=lambda item: item[2].step_s)
    fits = []
    unchecked = 0
    structural: dict = {}  # (tp, pp, cp, strategy) -> a rule problem that names neither batch nor checkpointing
    for choice, c, p in fitting:
        if len(fits) >= top:
            unchecked += 1
            continue
        d = c.distributed
        key = (d.tp_size, d.pp_size, d.cp_size, d.strategy)
        problems = [structural[key]] if key in structural else check(c, world_size)
        if problems and not any(w in problems[0] for w in ("batch", "activation", "pipeline.")):
            structural[key] = problems[0]
        if problems:
            rejected.append((choice, problems[0].split(":")[0]))
        else:
            fits.append((choice, p))
    return fits, rejected, unchecked
