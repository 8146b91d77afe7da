"""`meshforge plan --fit`: search the layouts real runs use for a world size and device, rank those that fit by
estimated step time, and say for each why it ranks where it does.

Searched: tp (inside a node), pp, cp, the strategies whose spec offers itself (`plan_search`, with the parallelisms
each composes with), activation checkpointing (none, selective, full), micro batch 1, 2, 4 (the pipeline's too);
for pipelines, virtual stages 1-8 per rank (1F1B for one, interleaved 1F1B for more) and uneven ends (an
embedding-only first stage and a head-only last stage, as Llama 3 405B ran); `reshard_after_forward` where the
strategy's options offer it (fsdp2 without PP: false, no re-gather in backward, the gathered blocks kept; under PP:
true, each micro batch re-gathers its stage, the stages no longer kept gathered through the schedule); FP8
(`training.fp8`) on a device whose efficiencies give float8 matmuls a speed-up. Kept from the config: the model,
the batch, and an MoE's ep_size (a layout whose dp x cp it does not divide is rejected; MoE stages run under PP).

The product of all of these is tens of thousands of plans; a plan answer must stay under 2 s. So, in two rounds:
  1. the structure (tp x pp x cp x strategy x checkpointing x micro batch) with the default pipeline (2 stages per
     rank when the blocks allow) is planned for every candidate: 420 plans for a 70B model at 1024 ranks;
  2. the `REFINE` fastest that fit are refined one choice at a time (coordinate descent: virtual stages with and
     without uneven ends, resharding, then FP8), each value that fits joining the candidates and the fastest kept
     for the next choice (kept when at least `GAIN` faster): under 10 plans each.
The config rules (the slow part: they check the TP plan on a meta model) run last, on the fastest candidates only,
until `top` pass. The model description is built once and shared by every candidate; a candidate that does not
fit is rejected once its memory is planned (its communication and time are never computed), and what the
strategies hold per stage and rank is memoised across candidates (planning/params.py `memo`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from meshforge.planning.params import model_params
from meshforge.planning.plan import Plan, plan

REFINE = 12  # candidates refined in round 2
VIRTUAL = (1, 2, 4, 8)  # stages per pipeline rank
GAIN = 0.005  # a refinement is kept when it is at least this much faster


@dataclass(frozen=True)
class Choice:
    strategy: str
    tp: int
    pp: int
    cp: int
    ac: str | bool
    mbs: int
    v: int = 0  # stages per pipeline rank (0: the default)
    uneven: bool = False  # first and last stage hold no blocks
    reshard: bool | None = None  # the strategy's reshard_after_forward (None: its default)
    fp8: bool = False

    def extras(self) -> int:
        """How many choices differ from the structure's defaults."""
        return (self.v != 0) + self.uneven + (self.reshard is not None) + self.fp8

    def label(self, world_size: int) -> str:
        dp = world_size // (self.tp * self.pp * self.cp)
        pipe = f"pp{self.pp}" + (f"x{self.v}v" if self.pp > 1 and self.v > 1 else "") + \
            ("+ends" if self.uneven else "")
        extra = {False: " reshard=no", True: " reshard=yes"}.get(self.reshard, "") + (" fp8" if self.fp8 else "")
        return f"{self.strategy} tp{self.tp} {pipe} cp{self.cp} dp{dp} ac={self.ac or 'none'} mbs={self.mbs}{extra}"


@dataclass
class Found:
    choice: Choice
    cfg: object
    plan: Plan
    reason: str = ""
    no_gain: bool = False  # a refinement that was no faster than what it refined: not a candidate of its own


def _structures(world_size: int, args, gpus_per_node: int):
    from meshforge.config.strategies import strategy_specs

    specs = [s for s in strategy_specs().values() if s.plan_search]  # the strategies whose specs offer themselves
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node and args.n_heads % t == 0 and args.n_kv_heads % t == 0]
    pps = [p for p in (1, 2, 4, 8, 16) if p <= args.n_layers]  # uneven splits too (405B: 126 blocks on pp 16)
    for tp, pp, cp, spec, ac, mbs in itertools.product(tps, pps, (1, 2, 4, 8), specs, (False, "selective", "full"),
                                                      (1, 2, 4)):
        axes = {"tp": tp > 1, "sp": tp > 1, "pp": pp > 1, "cp": cp > 1}
        if world_size % (tp * pp * cp) == 0 and all(a in spec.composes_with for a, used in axes.items() if used):
            yield Choice(spec.name, tp, pp, cp, ac, mbs)


def _configure(cfg, args, ch: Choice):
    from meshforge.config.schema import PipelineConfig

    # copies of the two sections a candidate changes; the rest (model, data, ...) is shared, never written
    c = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(deep=True),
                               "training": cfg.training.model_copy(deep=True)})
    d = c.distributed
    d.strategy = ch.strategy  # ValueError when the config carries options of another strategy
    d.tp_size, d.pp_size, d.cp_size, d.dp_size, d.dp_replicate_size = ch.tp, ch.pp, ch.cp, None, None
    d.activation_checkpointing = ch.ac
    d.sequence_parallel = ch.tp > 1
    c.training.micro_batch_size = ch.mbs
    c.training.fp8.enabled = ch.fp8
    if ch.reshard is not None:
        d.reshard_after_forward = ch.reshard
    if ch.pp > 1:
        v = ch.v or (2 if args.n_layers >= 2 * ch.pp else 1)
        ends = {"first_stage_layers": 0, "last_stage_layers": 0} if ch.uneven else {}
        d.pipeline = (PipelineConfig(pp_schedule="interleaved_1f1b", pp_microbatch_size=ch.mbs,
                                     virtual_stages_per_rank=v, **ends) if v > 1 else
                      PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=ch.mbs, **ends))
    return c


def search(cfg, world_size: int, device, gpus_per_node: int = 8, mfu: float | None = None, top: int = 5,
           efficiency=None):
    """([Found] that fit and pass the rules, fastest first, at most `top`, each with its reason; [(label, why)]
    rejected; the number of fitting candidates slower than those shown, whose rules were not checked)."""
    from meshforge.config.rules import check

    tp_cfg = cfg.model_copy(deep=True)
    tp_cfg.distributed.tp_size = 2  # resolve the TP plan's sharded dims once; tp 1 ignores them
    params, args = model_params(tp_cfg)
    gbs, ep = cfg.training.global_batch_size, cfg.distributed.ep_size
    rejected, cache, seen = [], {}, {}

    def try_(ch: Choice) -> Found | None:
        if ch in seen:
            return seen[ch]
        seen[ch] = None
        label = ch.label(world_size)
        dp = world_size // (ch.tp * ch.pp * ch.cp)
        if gbs % dp or (gbs // dp) % ch.mbs:
            rejected.append((label, f"global_batch_size {gbs} does not split into dp {dp} x micro batch {ch.mbs}"))
            return None
        if (dp * ch.cp) % ep:  # the expert ranks lie within dp x cp (config.rules checks it too, after the plan)
            rejected.append((label, f"distributed.ep_size={ep} does not divide dp {dp} x cp {ch.cp}"))
            return None
        try:
            c = _configure(cfg, args, ch)
            p = plan(c, world_size, device, gpus_per_node, mfu, params=params, args=args, state_cache=cache,
                     efficiency=efficiency, fitting_only=True)
        except Exception as err:  # noqa: BLE001 - a layout the config or planner refuses is a rejected layout
            problems = getattr(err, "problems", None) or [str(err)]
            rejected.append((label, problems[0].split(":")[0]))
            return None
        if p is None:  # (its time is not computed)
            rejected.append((label, "peak memory exceeds the device"))
            return None
        seen[ch] = Found(ch, c, p)
        return seen[ch]

    fitting = [f for f in map(try_, _structures(world_size, args, gpus_per_node)) if f is not None]
    fitting.sort(key=lambda f: f.plan.step_s)
    fp8 = _fp8_helps(efficiency, device)
    for f in fitting[:REFINE]:
        _refine(f, try_, args, fp8)
    # fastest first; of layouts that plan alike (a choice that changes nothing here), the simplest only
    fitting, alike = [], set()
    for f in sorted((f for f in seen.values() if f is not None and not f.no_gain),
                    key=lambda f: (f.plan.step_s, f.choice.extras())):
        sig = (f.choice.strategy, f.choice.tp, f.choice.pp, f.choice.cp, f.choice.ac, f.choice.mbs,
               round(f.plan.step_s, 6), f.plan.peak_rank.peak)
        if sig not in alike:
            alike.add(sig)
            fitting.append(f)
    fits: list[Found] = []
    unchecked = 0
    structural: dict = {}  # (tp, pp, cp, strategy) -> a rule problem that names neither batch nor checkpointing
    for f in fitting:
        if len(fits) >= top:
            unchecked += 1
            continue
        ch = f.choice
        key = (ch.tp, ch.pp, ch.cp, ch.strategy)
        problems = [structural[key]] if key in structural else check(f.cfg, world_size)
        if problems and not any(w in problems[0] for w in ("batch", "activation", "pipeline.", "fp8",
                                                             "reshard")):
            structural[key] = problems[0]
        if problems:
            rejected.append((ch.label(world_size), problems[0].split(":")[0]))
        else:
            fits.append(f)
    for i, f in enumerate(fits):
        f.reason = reason(f.plan, fits[0].plan, i)
    return fits, rejected, unchecked


def _refine(found: Found, try_, args, fp8: bool) -> None:
    """Coordinate descent from `found` over the inner choices, each fitting value a candidate, the fastest kept."""
    steps = []
    reshard = "reshard_after_forward" in _options_of(found.choice.strategy)  # a strategy that offers the choice
    if found.choice.pp > 1:
        # stages per rank with and without the uneven ends (some splits need the ends), each also resharded after
        # forward: under PP the stages stay gathered through the schedule unless resharded, so more stages per
        # rank may fit only when re-gathered per micro batch (memory traded for all-gathers)
        steps.append(lambda b: [replace(b, v=v, uneven=e, reshard=r) for v in VIRTUAL for e in (False, True)
                                for r in ((None, True) if reshard else (None,)) if b.pp * v <= args.n_layers + 2])
    elif reshard:
        steps.append(lambda b: [replace(b, reshard=False)])
    if fp8:
        steps.append(lambda b: [replace(b, fp8=True)])
    best = found
    for options in steps:
        for ch in options(best.choice):
            f = try_(ch)
            if f is not None and f.plan.step_s < best.plan.step_s * (1 - GAIN):
                best = f
            elif f is not None and f is not found:
                f.no_gain = True


def _options_of(strategy: str) -> set[str]:
    from meshforge.config.strategies import strategy_specs

    return set(strategy_specs()[strategy].options.model_fields)


def _fp8_helps(efficiency, device) -> bool:
    from meshforge.planning.hardware import default_efficiency

    eff = efficiency or default_efficiency(device)
    return eff.fp8_gemm_speedup > 1


PARTS = {"matmul": "matmuls", "attention": "attention", "elementwise": "elementwise work",
         "recompute": "recomputation", "optimizer": "optimizer step", "staging": "buffer copies",
         "host": "framework host time"}


def reason(p: Plan, best: Plan, rank: int) -> str:
    """One line: why this plan ranks where it does (its largest costs; beside the fastest, what it pays more)."""
    t = p.time
    costs = {PARTS[k]: v for k, v in t.parts.items() if k in PARTS}
    costs["exposed communication"] = t.exposed_s
    costs["pipeline bubble"] = t.idle_s
    head = f"peak {100 * p.peak_rank.peak / p.device.memory_bytes:.0f}% of memory"
    if rank == 0:
        top2 = sorted(costs.items(), key=lambda kv: -kv[1])[:2]
        return f"fastest: {', '.join(f'{k} {v:.3g} s' for k, v in top2)}; {head}"
    b = best.time
    base = {PARTS[k]: v for k, v in b.parts.items() if k in PARTS}
    base["exposed communication"] = b.exposed_s
    base["pipeline bubble"] = b.idle_s
    what, more = max(((k, v - base.get(k, 0.0)) for k, v in costs.items()), key=lambda kv: kv[1])
    pct = 100 * (p.step_s / best.step_s - 1)
    if pct < 0.05:
        return f"ties #1 (within 0.05%); {head}"
    return f"+{pct:.1f}% vs #1: {what} +{more:.3g} s; {head}"
