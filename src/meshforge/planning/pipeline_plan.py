"""How a pipeline-parallel run splits the model and feeds its schedule, computed without torch or processes.

`plan_pipeline` turns (number of blocks, pp size, the `distributed.pipeline`
section, the per-rank batch) into a `PipelinePlan`: how many stages, which
blocks each stage holds, which pp rank runs each stage, and how many
microbatches one schedule step carries. `config.rules` runs it before launch
(every problem comes back as one line naming the keys and numbers), and
`distributed.pipeline` builds exactly this plan, so what `meshforge validate`
accepts is what a run does.

Schedules (torch.distributed.pipelining class in brackets):
  1f1b [Schedule1F1B], gpipe [ScheduleGPipe]: one stage per rank.
  interleaved_1f1b [ScheduleInterleaved1F1B], looped_bfs [ScheduleLoopedBFS],
  zero_bubble [ScheduleInterleavedZeroBubble]: several stages per rank, stage s on rank s % pp.
  dfs [ScheduleInterleaved1F1B]: the depth-first schedule of the breadth-first-PP paper
  (arXiv 2211.05953), which is Megatron's interleaved 1F1B; torch documents its
  Interleaved1F1B as "depth first", the counterpart of LoopedBFS, and has no other class by that name.
  v_schedule [ScheduleZBVZeroBubble], dualpipev [ScheduleDualPipeV, DeepSeek-V3's DualPipe in a V; torch 2.13 has
  it, an older torch gets a one-line refusal at launch]: exactly two stages per rank in a V (rank r runs stages r
  and 2pp-1-r); dualpipev needs at least 2 x pp microbatches.
Multi-stage schedules default to 2 stages per rank when `virtual_stages_per_rank` is not set; any number the split
allows (`virtual_stages_per_rank`, or `layers_per_stage`) runs on the loop-style ones.

Uneven ends (`first_stage_layers`, `last_stage_layers`): the first stage holds that many blocks (and the
embedding), the last that many (and the final norm and head); 0 gives Llama 3 405B's layout, an embedding-only
first stage and a head-only last stage. The other stages share the remaining blocks evenly (at least one each);
with `layers_per_stage` they hold that many each and the stage count is those stages plus the explicit ends.

Microbatches: one schedule step per optimizer step carries this rank's whole
share of the global batch (global_batch_size / dp_size sequences), split into
microbatches of `pp_microbatch_size`. (One step per gradient-accumulation micro
batch would be wrong with torch's schedules: each step ends by scaling all
accumulated grads by 1/n_microbatches and forcing the FSDP reduce-scatter.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshforge.errors import PipelinePlanError

TORCH_SCHEDULE_CLASS = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "dfs": "ScheduleInterleaved1F1B",
    "v_schedule": "ScheduleZBVZeroBubble",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("1f1b", "gpipe")
V_SHAPED = ("v_schedule", "dualpipev")
# torch raises unless n_microbatches % max(1, n_microbatches // pp) == 0 for these
ROUNDS_SCHEDULES = ("interleaved_1f1b", "dfs", "zero_bubble")


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    pp: int
    stages_per_rank: int
    stage_layers: tuple[tuple[int, ...], ...]  # block indices of each stage, in model order
    n_microbatches: int
    microbatch_size: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def style(self) -> str:
        return "v" if self.schedule in V_SHAPED else "loop"

    @property
    def single_stage(self) -> bool:
        return self.schedule in SINGLE_STAGE

    def stage_rank(self, stage: int) -> int:
        """The pp rank that runs `stage`."""
        if self.style == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pp rank `pp_rank` runs, in increasing order."""
        return list(_rank_stages(self, pp_rank))

    @property
    def last_stage_rank(self) -> int:
        return self.stage_rank(self.num_stages - 1)


@functools.lru_cache(maxsize=4096)
def _rank_stages(plan: PipelinePlan, pp_rank: int) -> tuple[int, ...]:
    return tuple(s for s in range(plan.num_stages) if plan.stage_rank(s) == pp_rank)


def _explicit(pcfg, key: str) -> bool:
    return key in getattr(pcfg, "model_fields_set", set())


def plan_pipeline(n_layers: int, pp: int, pcfg, local_batch: int) -> PipelinePlan:
    """The plan, or PipelinePlanError listing every problem (one line each, naming keys and numbers)."""
    problems: list[str] = []
    v = _stages_per_rank(n_layers, pp, pcfg, problems)
    num_stages = pp * v
    _check_ends(n_layers, num_stages, pp, v, pcfg, problems)
    n_mb = _microbatches(pp, pcfg, local_batch, problems)
    if problems:
        raise PipelinePlanError(problems)
    layers = _split(n_layers, num_stages, pcfg.first_stage_layers, pcfg.last_stage_layers)
    return PipelinePlan(pcfg.pp_schedule, pp, v, layers, n_mb, pcfg.pp_microbatch_size)


def _ends(pcfg) -> tuple[int, int]:
    """(blocks the explicit ends hold, how many ends are explicit): `first_stage_layers` / `last_stage_layers`."""
    given = [n for n in (pcfg.first_stage_layers, pcfg.last_stage_layers) if n is not None]
    return sum(given), len(given)


def _stages_per_rank(n_layers: int, pp: int, pcfg, problems: list[str]) -> int:
    """Stages per rank: `virtual_stages_per_rank`, or what `layers_per_stage` gives (the stages other than explicit
    ends hold layers_per_stage blocks each), or the schedule's default (1 single-stage, else 2)."""
    p, sched = "distributed.pipeline", pcfg.pp_schedule
    v_set = _explicit(pcfg, "virtual_stages_per_rank")
    v = pcfg.virtual_stages_per_rank if v_set else (1 if sched in SINGLE_STAGE else 2)
    lps = pcfg.layers_per_stage
    fixed, n_ends = _ends(pcfg)
    shared = n_layers - fixed  # the blocks the stages other than explicit ends share
    if lps is not None and shared >= 0:
        if shared % lps:
            ends = f" minus the {fixed} blocks of first/last_stage_layers ({shared})" if n_ends else ""
            problems.append(f"model.n_layers={n_layers}{ends} is not divisible by {p}.layers_per_stage={lps}: "
                            f"choose a divisor of {shared}")
        elif (shared // lps + n_ends) % pp:
            with_ends = f" + {n_ends} explicit end stage(s)" if n_ends else ""
            problems.append(f"{p}.layers_per_stage={lps} gives {shared}/{lps}{with_ends} = {shared // lps + n_ends} "
                            f"stages, not a multiple of distributed.pp_size={pp}: choose layers_per_stage so that "
                            f"the stage count is a multiple of {pp}")
        else:
            from_lps = (shared // lps + n_ends) // pp
            if v_set and from_lps != v:
                problems.append(f"{p}.layers_per_stage={lps} gives {from_lps} stages per rank ({shared} blocks / "
                                f"{lps}{' + the ends' if n_ends else ''} / pp_size {pp}) but "
                                f"{p}.virtual_stages_per_rank={v}: set only one of them")
            v = from_lps
    if sched in SINGLE_STAGE and v != 1:
        problems.append(f"{p}.pp_schedule={sched} runs one stage per rank, but the split asks for {v} stages per rank "
                        f"(virtual_stages_per_rank/layers_per_stage): use a multi-stage schedule "
                        "(interleaved_1f1b, looped_bfs, dfs, zero_bubble, v_schedule, dualpipev) or one stage per rank")
    if sched in V_SHAPED and v != 2:
        problems.append(f"{p}.pp_schedule={sched} (a V) needs exactly 2 stages per rank, but the split asks for {v}: "
                        f"set {p}.virtual_stages_per_rank=2 (or layers_per_stage = n_layers/(2*pp_size))")
    return v


def _check_ends(n_layers: int, num_stages: int, pp: int, v: int, pcfg, problems: list[str]) -> None:
    """Every stage but an explicit end holds at least one block; the explicit ends hold what they say."""
    p = "distributed.pipeline"
    fixed, n_ends = _ends(pcfg)
    shared, middle = n_layers - fixed, num_stages - n_ends
    if not n_ends:
        if n_layers < num_stages:
            problems.append(f"model.n_layers={n_layers} is fewer than the {num_stages} pipeline stages "
                            f"(pp_size {pp} x {v} stages per rank): every stage needs at least one block; "
                            "lower pp_size/virtual_stages_per_rank or use a deeper model")
        return
    keys = " + ".join(f"{p}.{k}={getattr(pcfg, k)}" for k in ("first_stage_layers", "last_stage_layers")
                      if getattr(pcfg, k) is not None)
    if shared < 0:
        problems.append(f"{keys} = {fixed} blocks, more than model.n_layers={n_layers}: lower them")
    elif middle and shared < middle:
        problems.append(f"the {middle} stages between the ends need at least one block each, but model.n_layers="
                        f"{n_layers} - {keys} leaves {shared} (pp_size {pp} x {v} stages per rank): lower "
                        "pp_size/virtual_stages_per_rank or the ends' blocks")
    elif not middle and shared:
        problems.append(f"{keys} place {fixed} of model.n_layers={n_layers} blocks and no other stage is left for "
                        f"the other {shared}: set the ends so that they add up to {n_layers}, or leave one unset")


def _microbatches(pp: int, pcfg, local_batch: int, problems: list[str]) -> int:
    """Microbatches per schedule step, and the counts torch's schedules refuse."""
    p, sched, mbs = "distributed.pipeline", pcfg.pp_schedule, pcfg.pp_microbatch_size
    if local_batch % mbs:
        problems.append(f"the per-rank batch global_batch_size/dp_size = {local_batch} must be divisible by "
                        f"{p}.pp_microbatch_size={mbs}: choose a divisor of {local_batch}")
        return 0
    n_mb = local_batch // mbs
    least = {"1f1b": ("pp_size", pp), "dualpipev": ("2 x pp_size", 2 * pp)}.get(sched)
    if least is not None and n_mb < least[1]:
        problems.append(f"{p}.pp_schedule={sched} needs at least {least[0]}={least[1]} microbatches per step, but the "
                        f"per-rank batch {local_batch} / pp_microbatch_size {mbs} = {n_mb}: lower pp_microbatch_size "
                        "or raise training.global_batch_size")
    if sched in ROUNDS_SCHEDULES:
        rounds = max(1, n_mb // pp)
        if n_mb % rounds:
            problems.append(f"{p}.pp_schedule={sched} needs the microbatch count ({local_batch}/{mbs} = {n_mb}) "
                            f"to be a multiple of its rounds max(1, {n_mb}//pp_size {pp}) = {rounds}: use a "
                            f"multiple of {pp} microbatches (or fewer than {2 * pp})")
    return n_mb


def _split(n_layers: int, num_stages: int, first: int | None, last: int | None) -> tuple[tuple[int, ...], ...]:
    """Block indices per stage: explicit ends hold their count, the other stages share the rest evenly (extra blocks
    to the earliest: the last stage also holds the output)."""
    counts: list[int | None] = [None] * num_stages
    counts[0] = first if first is not None else counts[0]
    counts[-1] = last if last is not None else counts[-1]
    even = [s for s, c in enumerate(counts) if c is None]
    base, extra = divmod(n_layers - sum(c for c in counts if c is not None), max(1, len(even)))
    for i, s in enumerate(even):
        counts[s] = base + (1 if i < extra else 0)
    layers, start = [], 0
    for n in counts:
        layers.append(tuple(range(start, start + n)))
        start += n
    return tuple(layers)


def pipeline_problems(n_layers: int, pp: int, pcfg, local_batch: int) -> list[str]:
    try:
        plan_pipeline(n_layers, pp, pcfg, local_batch)
    except PipelinePlanError as err:
        return err.problems
    return []
