"""`meshforge plan`: memory per rank, communication, compute and step time of a config, without processes.

`plan` assembles the parts, each computed by its own module the way the run does it:
  params.py       the model's parameters as records (shapes, blocks, TP splits, experts, LoRA) from its
                  torch-free description
  state.py        what each rank holds of them after a step: its pipeline stages' parameters, kept as the
                  strategy's spec says (`StrategySpec.plan`, planning/terms.py); equal to what the bench counts
  activations.py  what autograd saves per micro batch, and how many micro batches a pipeline rank keeps alive
  comm.py         bytes per step per (mesh axis, collective kind), the strategy's own collectives from its spec
  step.py         compute from each rank's matmul, attention and elementwise work at the device's efficiencies
                  (`hardware.Efficiency`: datasheet defaults, a calibration on a measured run, or `--mfu`), plus
                  recomputation and the pipeline bubble; tensor/context/expert/pipeline traffic is on the critical
                  path (meshforge's eager TP collectives do not overlap compute), data-parallel traffic adds only
                  what compute does not hide
Every rank is planned for small worlds; large ones plan the ranks whose bytes can differ (`representative_ranks`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from meshforge.planning.activations import (
    activation_bytes,
    alive_at_backward,
    alive_peak,
    embedding_backward_bytes,
    lora_profile,
    loss_backward_bytes,
)
from meshforge.planning.comm import comm_per_step
from meshforge.planning.hardware import Device, Efficiency, default_efficiency, flat_efficiency
from meshforge.planning.headroom import Headroom, communicators
from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import ParamRec, model_params, n_params
from meshforge.planning.precision import bf16_params, compiled, fused_loss_note, on_cuda, residual_bytes
from meshforge.planning.state import pipeline_plan_of, rank_held, rank_state, spec_of, terms_of
from meshforge.planning.step import StepTime, flops_per_token, largest_state_per_pp_rank, step_time
from meshforge.planning.terms import Parts


@dataclass
class RankPlan:
    rank: int
    parts: Parts
    activations: dict[str, int]
    in_flight: int  # micro batches whose activations are alive at once
    peak: int
    moments: dict[str, int] = field(default_factory=dict)  # bytes live at each candidate moment of the peak


@dataclass
class Plan:
    world_size: int
    layout: Layout
    strategy: str
    mode: str | None
    ranks: list[RankPlan]
    comm: dict[tuple[str, str], int]
    comm_s: float
    compute_s: float
    bubble: float
    step_s: float
    tokens_per_s: float
    mfu: float
    flops_per_token: float
    n_params: int
    device: Device
    fits: bool
    notes: list[str] = field(default_factory=list)
    # what the device needs beyond the peak rank's tensors (planning/headroom.py), by margin
    headroom: dict[str, int] = field(default_factory=dict)
    efficiency: Efficiency | None = None
    time: StepTime | None = None  # the step time's parts (step.py)

    @property
    def required_bytes(self) -> int:
        """The peak rank's tensors plus the headroom: what must be at most the device's memory to fit."""
        return self.peak_rank.peak + sum(self.headroom.values())

    @property
    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak)

    def rank(self, rank: int) -> RankPlan:
        """The plan of global rank `rank` (planned when `plan(..., ranks=)` asked for it)."""
        return next(r for r in self.ranks if r.rank == rank)

    def to_dict(self) -> dict:
        pr = self.peak_rank
        return {
            "world_size": self.world_size, "layout": self.layout.named_shape() | {"ep": self.layout.ep},
            "strategy": self.strategy, "sharding": self.mode, "n_params": self.n_params,
            "device": dataclasses.asdict(self.device),
            "ranks": [{"rank": r.rank, **{k: getattr(r.parts, k) for k in ("params", "grads", "optimizer", "host",
                                                                           "buffers")},
                       "activations": r.activations, "in_flight_microbatches": r.in_flight, "peak": r.peak,
                       "moments": r.moments}
                      for r in self.ranks],
            "peak_bytes": pr.peak, "peak_rank": pr.rank, "headroom": self.headroom,
            "required_bytes": self.required_bytes, "fits": self.fits,
            "comm": [{"axis": a, "kind": k, "bytes": b} for (a, k), b in self.comm.items()],
            "comm_s": self.comm_s, "compute_s": self.compute_s, "pp_bubble": self.bubble, "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "flops_per_token": self.flops_per_token,
            "notes": self.notes, "efficiency": self.efficiency.to_dict() if self.efficiency else None,
            "compute_parts_s": self.time.parts if self.time else None,
            "busy_s": self.time.busy_s if self.time else None,
        }



def _stage_signature(pplan, pp_rank: int) -> tuple:
    here = pplan.rank_stages(pp_rank)
    return (tuple(len(pplan.stage_layers[s]) for s in here), 0 in here, pplan.num_stages - 1 in here)


def representative_ranks(layout: Layout, every: bool = False) -> list[int]:
    """Every rank for small worlds (or when the strategy's terms say its ranks differ more, `every`); else, per pp
    rank, the first and the last dp_shard_cp shard (the only ranks whose bytes differ: the first shards hold the
    most optimizer state, padding lands on the last)."""
    if every or layout.world_size <= 64:
        return list(range(layout.world_size))
    out = set()
    for pp in range(layout.pp):
        for sh, cp in {(0, 0), (layout.dp_shard - 1, layout.cp - 1)}:
            out.add(layout.rank_of({MeshAxis.PP: pp, MeshAxis.DP_REPLICATE: 0, MeshAxis.DP_SHARD: sh,
                                    MeshAxis.CP: cp, MeshAxis.TP: 0}))
    return sorted(out)




def plan(cfg, world_size: int, device: Device, gpus_per_node: int = 8, mfu: float | None = None,
         params: list[ParamRec] | None = None, args=None, state_cache: dict | None = None,
         efficiency: Efficiency | None = None, ranks: list[int] | None = None,
         headroom: Headroom | None = None, fitting_only: bool = False) -> Plan | None:
    """The plan of `cfg` on `world_size` devices like `device`, its step time priced with `efficiency` (default:
    the device's stated defaults; `mfu` alone: the one-number model). `params`/`args` from `model_params` and a
    `state_cache` dict let a search share the work between candidates; `ranks`: plan these ranks too, beside the
    representative ones; `headroom`: the margins the verdict adds to the peak, `Headroom()` by default;
    `fitting_only` (a search): None for a layout that does not fit, its communication and time not computed."""
    d, t = cfg.distributed, cfg.training
    eff = efficiency or (flat_efficiency(mfu) if mfu is not None else default_efficiency(device))
    layout = Layout.from_sizes(world_size, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size,
                               dp=d.dp_size, dp_replicate=d.dp_replicate_size)
    if params is None:
        params, args = model_params(cfg)
    pplan = pipeline_plan_of(cfg, layout, args.n_layers) if layout.pp > 1 else None
    # what a rank's state and held bytes depend on (a search varies the pipeline and the micro batch too)
    key = (layout, d.strategy, d.options.model_dump_json(), d.pipeline and d.pipeline.model_dump_json(),
           t.model_dump_json(include={"device", "precision", "micro_batch_size", "global_batch_size", "fp8"}))
    if ranks or state_cache is None or key not in state_cache:
        states = _rank_states(params, cfg, layout, pplan, ranks or [])
        if state_cache is not None and not ranks:
            state_cache[key] = states
    else:
        states = state_cache[key]
    ranks = _rank_plans(states, args, cfg, layout, pplan)
    peak = max(r.peak for r in ranks)
    margins = (headroom or Headroom()).parts(peak, communicators(layout), compiled(cfg), cfg.training.fp8.enabled)
    fits = peak + sum(margins.values()) <= device.memory_bytes
    if fitting_only and not fits:
        return None
    comm = comm_per_step(params, args, cfg, layout)
    timing = step_time(params, args, cfg, layout, pplan, device, eff, _comm_of_pp_rank(params, args, cfg, layout,
                                                                                      pplan, comm),
                       gpus_per_node, largest_state_per_pp_rank(states, layout))
    model_fpt = flops_per_token(args, t.seq_len)
    tokens = t.global_batch_size * t.seq_len
    step_s = timing.step_s
    achieved = tokens * model_fpt / step_s / world_size / (device.peak_tflops * 1e12)
    return Plan(world_size, layout, d.strategy, terms_of(cfg).sharding(d.options), ranks, comm, timing.comm_s,
                timing.compute_s, timing.bubble, step_s, tokens / step_s, achieved, model_fpt, n_params(params),
                device, fits, _notes(cfg, eff, layout), margins, eff, timing)


def _comm_of_pp_rank(params: list[ParamRec], args, cfg, layout: Layout, pplan, rank0: dict):
    """pp rank -> the bytes the first rank of that pipeline rank hands to collectives (pipeline ranks whose stages
    hold alike blocks and ends send alike: each distinct one is counted once, when asked)."""
    same = {_stage_signature(pplan, 0) if pplan is not None else None: rank0}

    def comm_of(r: int) -> dict:
        sig = _stage_signature(pplan, r) if pplan is not None else None
        if sig not in same:
            same[sig] = comm_per_step(params, args, cfg, layout, layout.rank_of(
                {MeshAxis.PP: r, MeshAxis.DP_REPLICATE: 0, MeshAxis.DP_SHARD: 0, MeshAxis.CP: 0, MeshAxis.TP: 0}))
        return same[sig]

    return comm_of


def _rank_states(params: list[ParamRec], cfg, layout: Layout, pplan, extra: list[int]
                 ) -> list[tuple[int, Parts, dict[str, int]]]:
    """[(rank, its state after a step, what its strategy holds at each moment of the peak)] of the representative
    ranks. Ranks whose pipeline stages hold the same number of blocks (and the same ends of the model) at the same
    data-parallel coordinates hold the same bytes: each distinct one is computed once."""
    t = cfg.training
    accum = t.global_batch_size // layout.dp // t.micro_batch_size
    states, same = [], {}
    n_layers = sum(len(blocks) for blocks in pplan.stage_layers) if pplan is not None else None
    stages_of = functools.cache(lambda pp: pp if pplan is None else _stage_signature(pplan, pp))  # per pp rank
    for r in sorted(set(representative_ranks(layout, every=terms_of(cfg).every_rank)) | set(extra)):
        c = layout.coords(r)
        sig = (c[MeshAxis.DP_SHARD_CP], c[MeshAxis.DP_CP], c[MeshAxis.EP_SHARD], stages_of(c[MeshAxis.PP]))
        if sig not in same:
            same[sig] = (rank_state(params, cfg, layout, r, n_layers), rank_held(params, cfg, layout, r, accum,
                                                                                 n_layers))
        states.append((r, *same[sig]))
    return states


def _rank_plans(states: list[tuple[int, Parts, dict]], args, cfg, layout: Layout, pplan) -> list[RankPlan]:
    """Each rank's peak: the larger of its moments (what was measured to be live, with the scale trace):
      head   the loss's backward on the last micro batch: optimizer state, what the strategy holds then
             (`StrategyPlanTerms.held`), every activation alive (a pipeline rank's in-flight micro batches) and,
             on the rank with the last stage, the loss backward's own tensors (`loss_backward_bytes`);
      block  a block's backward (its recomputation under activation checkpointing), the head's activations freed,
             what the strategy holds then;
      end    the last reductions, activations gone;
      forward    the strategy's own gathers in forward (fsdp2: a block's unshard beside the root), no activations;
      embedding  (a pipeline's first stage) the embedding's backward in the schedule's steady state."""

    @functools.cache
    def acts_of(blocks: int, first: bool, last: bool) -> dict:
        return activation_bytes(args, cfg, layout, blocks, first, last, pplan.microbatch_size if pplan else None)

    loss_bw = loss_backward_bytes(args, cfg, layout, pplan.microbatch_size if pplan else None)
    emb_bw = embedding_backward_bytes(args, cfg, layout, pplan.microbatch_size) if pplan else 0
    # a pipeline stage's receive buffers, one per micro batch, kept across steps (torch's PipelineStage makes them
    # at its first step): the activations a stage receives and the gradients it receives back
    hidden = 0 if pplan is None else (pplan.microbatch_size * cfg.training.seq_len // layout.cp // (
        layout.tp if cfg.distributed.sequence_parallel else 1) * args.dim * residual_bytes(cfg, layout))

    @functools.cache
    def activations_of(pp_rank: int) -> tuple:
        """(activations, alive bytes, in-flight micro batches, receive buffers, first, last, alive at the loss's
        backward, alive at the embedding's) of a pp rank's ranks."""
        if pplan is None:
            acts = acts_of(args.n_layers, True, True)
            return acts, acts["total"], 1, 0, True, True, acts["total"], acts["total"]
        here = pplan.rank_stages(pp_rank)
        blocks = sum(len(pplan.stage_layers[s]) for s in here) // len(here)
        weights = tuple(acts_of(len(pplan.stage_layers[s]), s == 0, s == pplan.num_stages - 1)["total"]
                        for s in here)
        alive, in_flight = alive_peak(pplan.schedule, layout.pp, pp_rank, pplan.n_microbatches, weights)
        # the activations alive when the loss's (the embedding's) backward runs: a backward of the last (first)
        # stage; the schedule's peak, in some forward, is a moment without either's buffers
        at_loss, at_emb = (alive_at_backward(pplan.schedule, layout.pp, pp_rank, pplan.n_microbatches, weights,
                                             here.index(s)) if s in here else alive
                           for s in (pplan.num_stages - 1, 0))
        recv = pplan.n_microbatches * hidden * sum((s > 0) + (s < pplan.num_stages - 1) for s in here)
        first, last = 0 in here, pplan.num_stages - 1 in here
        return acts_of(blocks, first, last), alive, in_flight, recv, first, last, at_loss, at_emb

    ranks = []
    for r, parts, held in states:
        shared, alive, in_flight, recv, first, last, at_loss, at_emb = activations_of(layout.coords(r)[MeshAxis.PP])
        acts = dict(shared)
        base = parts.optimizer + recv
        moments = {"head": base + held["head"] + max(alive, at_loss + (loss_bw if last else 0)),
                   "block": base + held["block"] + alive - acts["head"] + acts["recompute"],
                   "end": base + held["end"] + (acts["embedding"] if first else 0)}
        if held["forward"]:  # the strategy's gathers in forward, the embedding's output the activation then
            moments["forward"] = parts.optimizer + held["forward"] + acts["embedding"]
        if pplan is not None and first:  # a first stage's embedding backward, in the schedule's steady state
            moments["embedding"] = base + held["head"] + max(alive, at_emb + emb_bw)
        peak = max(moments.values())
        ranks.append(RankPlan(r, parts, acts, in_flight, peak, moments))
    return ranks


def _notes(cfg, eff: Efficiency, layout: Layout | None = None) -> list[str]:
    """What the plan does not count exactly for this config, said with the plan."""
    out = []
    d = cfg.distributed
    if cfg.training.fp8.enabled:
        out.append(f"training.fp8: the step time prices the linears torchao converts at {eff.fp8_gemm_speedup:g}x "
                   f"the bf16 matmul rate ({eff.source})")
    if d.tp_size > 1 and eff.host_s_per_call > 0 and not eff.overlap:
        out.append("tensor parallelism: DTensor's host time is not in the step time (on a CPU core it doubled a "
                   "small model's measured step: tests/parallel/test_time_calibration.py)")
    if compiled(cfg):
        out.append("training.compile: step time priced with eager kernels (compile's fusion of elementwise work is "
                   "not credited)")
    if compiled(cfg):
        out.append("training.compile: activations are counted as measured with torch.compile on CPU (eager's "
                   "tensors, and under sequence parallelism without checkpointing each sub-layer's gathered input "
                   "whole, where eager keeps the shard); inductor's partitioner on CUDA may keep less")
    if cfg.peft is not None and d.tp_size * d.cp_size > 1:
        out.append("LoRA: activations are exact on one process; under tensor/context parallelism they were "
                   "measured within 0.4% (TP2 + sequence parallelism +0.2%, CP2 +0.4%), not exact")
    if bf16_params(cfg) and d.tp_size > 1:
        out.append("bf16_params: activations (bf16) are exact on one process and within 0.8% under context "
                   "parallelism (CP2); under tensor parallelism they are counted alike but not measured")
    if cfg.peft is not None and lora_profile(cfg, _args_of(cfg)) is None:
        out.append("LoRA: activations are counted as for full training (this model's adapter roles are not the "
                   "Llama block's); parameters, gradients, optimizer state and communication are exact")
    if cfg.model.hf_model:
        from meshforge.planning.hf_activations import unmeasured_note

        out += [n for n in (unmeasured_note(cfg),) if n]
        if on_cuda(cfg):
            out.append("model.hf_model on a GPU: its activations and TP collectives are counted in fp32 (or CPU "
                       "autocast's dtypes), where the GPU's bf16 gathers make the model compute in bf16: over by "
                       "6-10% in the scale trace (docs/scale.md); fp32 on CPU is checked")
        spec = spec_of(cfg)
        if spec is not None and not spec.shards_parameters and layout is not None and layout.size("dp_cp") > 1:
            out.append("model.hf_model with whole replicas: the broadcast of the model's buffers (e.g. its rotary "
                       "tables) before every forward is not counted (a few hundred bytes a step)")
        if d.ep_size > 1:
            out.append("model.hf_model with expert parallelism: the token copies' all-to-all is not counted (the "
                       "plan does not read transformers' top-k); the rest of the communication is")
    if d.pp_size > 1 and d.pipeline_or_default.pp_schedule == "dualpipev":
        out.append("pp_schedule=dualpipev: its bubble and in-flight microbatches are counted as interleaved 1F1B's "
                   "over the V's two stages per rank (DualPipeV's overlap of one microbatch's forward with "
                   "another's backward is not modelled)")
    fused = fused_loss_note(cfg)
    if fused:
        out.append(fused)
    if cfg.training.fp8.enabled:
        out.append("training.fp8: counted as the scale trace measures torchao's float8 linears: weights, gradients "
                   "and optimizer state in their own dtype, the high-precision inputs and weights kept for backward "
                   "(no float8 copies), a strategy's float8 all-gather (1 byte an element, its gathered units held "
                   "so) and the amax all-reduces; not counted: a linear's transient float8 casts (-1.3% where the "
                   "peak falls in a block's backward, docs/scale.md) and, under TP without checkpointing, the float8 "
                   "cast of a projection's input kept in place of the bf16 one (+0.03%)")
    spec = spec_of(cfg)
    if spec is None or spec.plan is None:
        out.append(f"strategy {d.strategy} declares no planner terms (StrategySpec.plan, planning/terms.py): its "
                   "parameters, gradients and optimizer state are counted as full replicas on every rank and its "
                   "gradients as one all-reduce per step, whatever it really keeps and sends")
    return out


def _args_of(cfg):
    from meshforge.models import resolve_model_args

    return resolve_model_args(cfg.model)
