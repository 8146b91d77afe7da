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
  v_schedule [ScheduleZBVZeroBubble]: exactly two stages per rank in a V (rank r runs stages r and 2pp-1-r).
Multi-stage schedules default to 2 stages per rank when `virtual_stages_per_rank` is not set.

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
}
SINGLE_STAGE = ("1f1b", "gpipe")
V_SHAPED = ("v_schedule",)
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
    p = "distributed.pipeline"
    sched = pcfg.pp_schedule
    problems: list[str] = []
    v_set = _explicit(pcfg, "virtual_stages_per_rank")
    v = pcfg.virtual_stages_per_rank if v_set else (1 if sched in SINGLE_STAGE else 2)
    lps = pcfg.layers_per_stage
    if lps is not None:
        if n_layers % lps:
            problems.append(f"model.n_layers={n_layers} is not divisible by {p}.layers_per_stage={lps}: "
                            f"choose a divisor of {n_layers}")
        elif (n_layers // lps) % pp:
            problems.append(f"{p}.layers_per_stage={lps} gives {n_layers}/{lps} = {n_layers // lps} stages, not a "
                            f"multiple of distributed.pp_size={pp}: choose layers_per_stage so that n_layers/"
                            f"layers_per_stage is a multiple of {pp}")
        else:
            from_lps = n_layers // lps // pp
            if v_set and from_lps != v:
                problems.append(f"{p}.layers_per_stage={lps} gives {from_lps} stages per rank ({n_layers} blocks / "
                                f"{lps} / pp_size {pp}) but {p}.virtual_stages_per_rank={v}: set only one of them")
            v = from_lps
    if sched in SINGLE_STAGE and v != 1:
        problems.append(f"{p}.pp_schedule={sched} runs one stage per rank, but the split asks for {v} stages per rank "
                        f"(virtual_stages_per_rank/layers_per_stage): use a multi-stage schedule "
                        "(interleaved_1f1b, looped_bfs, dfs, zero_bubble, v_schedule) or one stage per rank")
    if sched in V_SHAPED and v != 2:
        problems.append(f"{p}.pp_schedule={sched} (ZB-V) needs exactly 2 stages per rank, but the split asks for {v}: "
                        f"set {p}.virtual_stages_per_rank=2 (or layers_per_stage = n_layers/(2*pp_size))")
    num_stages = pp * v
    if n_layers < num_stages:
        problems.append(f"model.n_layers={n_layers} is fewer than the {num_stages} pipeline stages "
                        f"(pp_size {pp} x {v} stages per rank): every stage needs at least one block; "
                        "lower pp_size/virtual_stages_per_rank or use a deeper model")
    mbs = pcfg.pp_microbatch_size
    n_mb = 0
    if local_batch % mbs:
        problems.append(f"the per-rank batch global_batch_size/dp_size = {local_batch} must be divisible by "
                        f"{p}.pp_microbatch_size={mbs}: choose a divisor of {local_batch}")
    else:
        n_mb = local_batch // mbs
        if sched == "1f1b" and n_mb < pp:
            problems.append(f"{p}.pp_schedule=1f1b needs at least pp_size={pp} microbatches per step, but the per-rank "
                            f"batch {local_batch} / pp_microbatch_size {mbs} = {n_mb}: lower pp_microbatch_size or "
                            "raise training.global_batch_size")
        if sched in ROUNDS_SCHEDULES:
            rounds = max(1, n_mb // pp)
            if n_mb % rounds:
                problems.append(f"{p}.pp_schedule={sched} needs the microbatch count ({local_batch}/{mbs} = {n_mb}) "
                                f"to be a multiple of its rounds max(1, {n_mb}//pp_size {pp}) = {rounds}: use a "
                                f"multiple of {pp} microbatches (or fewer than {2 * pp})")
    if problems:
        raise PipelinePlanError(problems)
    base, extra = divmod(n_layers, num_stages)
    layers, start = [], 0
    for s in range(num_stages):  # extra blocks go to the earliest stages (the last one also holds the output)
        n = base + (1 if s < extra else 0)
        layers.append(tuple(range(start, start + n)))
        start += n
    return PipelinePlan(sched, pp, v, tuple(layers), n_mb, mbs)


def pipeline_problems(n_layers: int, pp: int, pcfg, local_batch: int) -> list[str]:
    try:
        plan_pipeline(n_layers, pp, pcfg, local_batch)
    except PipelinePlanError as err:
        return err.problems
    return []
