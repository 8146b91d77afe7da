"""`meshforge plan`: memory per rank, communication, compute and step time of a config, without processes.

`plan` assembles the parts, each computed by its own module the way the run does it:
  params.py       the model's parameters as records (shapes, blocks, TP splits, experts, LoRA) from its
                  torch-free description
  state.py        what each rank holds of them after a step: its pipeline stages' parameters, kept as the
                  strategy's spec says (`StrategySpec.plan`, planning/terms.py); equal to what the bench counts
  activations.py  what autograd saves per micro batch, and how many micro batches a pipeline rank keeps alive
  comm.py         bytes per step per (mesh axis, collective kind), the strategy's own collectives from its spec
  step.py         compute from the model contract's FLOPs per token at an assumed efficiency (`mfu`), plus
                  recomputation and the pipeline bubble; tensor/context/expert/pipeline traffic is on the critical
                  path (meshforge's eager TP collectives do not overlap compute), data-parallel traffic adds only
                  what compute does not hide
Every rank is planned for small worlds; large ones plan the ranks whose bytes can differ (`representative_ranks`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from meshforge.planning.activations import activation_bytes, alive_peak, lora_profile
from meshforge.planning.comm import comm_per_step
from meshforge.planning.hardware import Device
from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import ParamRec, model_params, n_params
from meshforge.planning.precision import bf16_params, compiled, fused_loss_note
from meshforge.planning.state import pipeline_plan_of, rank_state, spec_of, terms_of
from meshforge.planning.step import bubble_fraction, comm_seconds, flops_per_token
from meshforge.planning.terms import Parts


@dataclass
class RankPlan:
    rank: int
    parts: Parts
    activations: dict[str, int]
    in_flight: int  # micro batches whose activations are alive at once
    peak: int


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

    @property
    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.peak)

    def to_dict(self) -> dict:
        pr = self.peak_rank
        return {
            "world_size": self.world_size, "layout": self.layout.named_shape() | {"ep": self.layout.ep},
            "strategy": self.strategy, "sharding": self.mode, "n_params": self.n_params,
            "device": dataclasses.asdict(self.device),
            "ranks": [{"rank": r.rank, **{k: getattr(r.parts, k) for k in ("params", "grads", "optimizer", "host",
                                                                           "buffers")},
                       "activations": r.activations, "in_flight_microbatches": r.in_flight, "peak": r.peak}
                      for r in self.ranks],
            "peak_bytes": pr.peak, "peak_rank": pr.rank, "fits": self.fits,
            "comm": [{"axis": a, "kind": k, "bytes": b} for (a, k), b in self.comm.items()],
            "comm_s": self.comm_s, "compute_s": self.compute_s, "pp_bubble": self.bubble, "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "flops_per_token": self.flops_per_token,
            "notes": self.notes,
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




def plan(cfg, world_size: int, device: Device, gpus_per_node: int = 8, mfu: float = 0.4,
         params: list[ParamRec] | None = None, args=None, state_cache: dict | None = None) -> Plan:
    """The plan of `cfg` on `world_size` devices like `device` (`params`/`args` from `model_params` and a
    `state_cache` dict let a search share the work between candidates)."""
    d, t = cfg.distributed, cfg.training
    layout = Layout.from_sizes(world_size, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size,
                               dp=d.dp_size, dp_replicate=d.dp_replicate_size)
    if params is None:
        params, args = model_params(cfg)
    pplan = pipeline_plan_of(cfg, layout, args.n_layers) if layout.pp > 1 else None
    key = (layout, d.strategy, d.options.model_dump_json(), t.device)
    if state_cache is None or key not in state_cache:
        states = _rank_states(params, cfg, layout, pplan)
        if state_cache is not None:
            state_cache[key] = states
    else:
        states = state_cache[key]
    ranks = _rank_plans(states, args, cfg, layout, pplan)
    comm = comm_per_step(params, args, cfg, layout)
    secs = {key: comm_seconds(key, n, layout, device, gpus_per_node) for key, n in comm.items()}
    comm_s = sum(secs.values())
    model_fpt = flops_per_token(args, t.seq_len)
    tokens = t.global_batch_size * t.seq_len
    recompute = {None: 1.0, "full": 4 / 3, "selective": 1.05}[d.ac_mode]
    flops = tokens * model_fpt * recompute
    if layout.cp > 1:  # context parallelism recomputes the local attention forward in backward
        from meshforge.models.shapes import attention_forward_flops_per_token

        flops += tokens * attention_forward_flops_per_token(args, t.seq_len)
    compute_s = flops / world_size / (device.peak_tflops * 1e12 * mfu)
    bubble = 0.0
    if pplan is not None:
        bubble = bubble_fraction(pplan.schedule, layout.pp, pplan.n_microbatches, pplan.stages_per_rank)
    # data-parallel traffic overlaps compute; what does not hide adds; TP/CP/EP traffic is on the critical path
    exposed = sum(sec for (a, _k), sec in secs.items() if a in ("tp", "cp", "ep", "pp"))
    hidden = comm_s - exposed
    step_s = compute_s / (1 - bubble) + exposed + max(0.0, hidden - compute_s)
    tps = tokens / step_s
    achieved = tokens * model_fpt / step_s / world_size / (device.peak_tflops * 1e12)
    peak = max(r.peak for r in ranks)
    return Plan(world_size, layout, d.strategy, terms_of(cfg).sharding(d.options), ranks, comm, comm_s, compute_s,
                bubble, step_s, tps, achieved, model_fpt, n_params(params), device, peak <= device.memory_bytes,
                _notes(cfg))


def _rank_states(params: list[ParamRec], cfg, layout: Layout, pplan) -> list[tuple[int, Parts]]:
    """[(rank, its state)] of the representative ranks. Ranks whose pipeline stages hold the same number of blocks
    (and the same ends of the model) at the same data-parallel coordinates hold the same bytes: each distinct one
    is computed once."""
    states, same = [], {}
    for r in representative_ranks(layout, every=terms_of(cfg).every_rank):
        c = layout.coords(r)
        sig = (c[MeshAxis.DP_SHARD_CP], c[MeshAxis.DP_CP], c[MeshAxis.EP_SHARD], c[MeshAxis.PP] if pplan is None
               else _stage_signature(pplan, c[MeshAxis.PP]))
        if sig not in same:
            same[sig] = rank_state(params, cfg, layout, r)
        states.append((r, same[sig]))
    return states


def _rank_plans(states: list[tuple[int, Parts]], args, cfg, layout: Layout, pplan) -> list[RankPlan]:
    """Each rank's state beside the activations its stages keep alive at the peak."""

    @functools.cache
    def acts_of(blocks: int, first: bool, last: bool) -> dict:
        return activation_bytes(args, cfg, layout, blocks, first, last, pplan.microbatch_size if pplan else None)

    ranks = []
    for r, parts in states:
        c = layout.coords(r)
        if pplan is not None:
            here = pplan.rank_stages(c[MeshAxis.PP])
            blocks = sum(len(pplan.stage_layers[s]) for s in here) // len(here)
            first, last = 0 in here, pplan.num_stages - 1 in here
            acts = dict(acts_of(blocks, first, last))
            weights = tuple(acts_of(len(pplan.stage_layers[s]), s == 0, s == pplan.num_stages - 1)["total"]
                            for s in here)
            alive, in_flight = alive_peak(pplan.schedule, layout.pp, c[MeshAxis.PP], pplan.n_microbatches, weights)
        else:
            acts = dict(acts_of(args.n_layers, True, True))
            in_flight, alive = 1, acts["total"]
        peak = parts.total + parts.buffers + alive + acts["recompute"]
        ranks.append(RankPlan(r, parts, acts, in_flight, peak))
    return ranks


def _notes(cfg) -> list[str]:
    """What the plan does not count exactly for this config, said with the plan."""
    out = []
    d = cfg.distributed
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
    if d.pp_size > 1 and d.pipeline_or_default.pp_schedule == "dualpipev":
        out.append("pp_schedule=dualpipev: its bubble and in-flight microbatches are counted as interleaved 1F1B's "
                   "over the V's two stages per rank (DualPipeV's overlap of one microbatch's forward with "
                   "another's backward is not modelled)")
    fused = fused_loss_note(cfg)
    if fused:
        out.append(fused)
    if cfg.training.fp8.enabled:
        out.append("training.fp8: counted as without it (weights, gradients and optimizer state stay in their "
                   "dtype, exactly); not counted: a sharding strategy's float8 all-gather (1 byte an element, "
                   "where the plan counts the gathered dtype), the float8 copies the matmuls keep for backward, "
                   "and the float8 scales' small all-reduces (under TP and sharded weights)")
    spec = spec_of(cfg)
    if spec is None or spec.plan is None:
        out.append(f"strategy {d.strategy} declares no planner terms (StrategySpec.plan, planning/terms.py): its "
                   "parameters, gradients and optimizer state are counted as full replicas on every rank and its "
                   "gradients as one all-reduce per step, whatever it really keeps and sends")
    return out


def _args_of(cfg):
    from meshforge.models import resolve_model_args

    return resolve_model_args(cfg.model)
