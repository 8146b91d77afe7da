"""The step time: each rank's compute from the shapes of its matmuls, attention and elementwise work priced with
the device's efficiencies (`hardware.Efficiency`), the pipeline bubble of its schedule, and the seconds its
collectives take on a ring over NVLink or the fabric (`step_time`).

Compute of one micro batch through one stage, forward and backward (per rank, after TP/CP/EP splits):
  matmuls       every block weight is one matmul of (tokens, out, in) (a routed expert: tokens*top_k/experts
                rows each), the output head (tokens, vocab/tp, dim) on the last stage. Forward once, backward
                twice (input and weight gradients; a frozen weight only the input's). Each is priced on a
                roofline with a size curve: max(FLOPs / (peak x gemm), bytes / (bandwidth x memory)) plus a fixed
                time per kernel, so small and split matmuls run below the large ones' rate. Under training.fp8 the
                blocks' linears that torchao converts run `fp8_gemm_speedup` times faster.
  attention     the causal attention's FLOPs (forward x 3 for forward and backward) at the device's attention
                fraction of the peak at this sequence length.
  elementwise   norms, RoPE, SwiGLU, residuals, the loss' softmax and the embedding as memory traffic, forward
                and backward: per token and block 73*dim + 23*(q + k width) + 16*ffn width elements, the head
                and loss 20*dim + 10*vocab (15*vocab with the fused loss, which recomputes the logits), the
                embedding 10*dim (measured: the inputs and outputs of every non-matmul kernel of meshforge's
                blocks counted with a dispatch mode, CPU fp32; tensor parallelism splits the widths, sequence
                parallelism the dim terms too; a MoE block's routed width is top_k experts' plus 8*top_k*dim of
                dispatch copies, not measured), at the device's memory bandwidth; a third of it is forward.
  recompute     full checkpointing runs the blocks' forward again (matmuls, attention, elementwise), selective
                only the elementwise part (matmul and attention outputs are cached); context parallelism runs the
                local attention forward again.
A rank's step: its stages x micro batches, then the optimizer (AdamW streams parameters, gradients and both moments:
2 x params + grads + 2 x optimizer bytes) and the staging of the data-parallel collectives' buffers (each copied in
and out once: FSDP's copy-in/out, DDP's buckets; read and write, 2 x their bytes), all x the calibrated
`compute_scale`; and the framework's host time, `host_s_per_call` per framework call: each forward and backward of
a unit (a block, or the rest of a stage) whose parameters a data-parallel strategy gathers (its hooks, copies and
dispatch; the plan's own all-gathers say whether it gathers). It adds on a CPU core, and on a GPU only where it
exceeds the device's compute (the host runs ahead). A pipeline schedule's own host time per action was measured
small beside it on a CPU core and is not counted, nor is DTensor's under tensor parallelism (measured large on a
CPU core: the plan notes it).
Each pipeline rank is priced with its own stages and communication; the slowest sets the pace, the schedule's
bubble adds idle time. Tensor/context/expert/pipeline traffic is on the critical path (meshforge's eager TP
collectives do not overlap compute); data-parallel traffic adds only what compute does not hide, on a device that
overlaps (a CPU core does not: there every collective adds).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from meshforge.planning.hardware import Device, Efficiency
from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import F32, ParamRec, memo
from meshforge.planning.precision import FP8_AUTO, bf16_compute, fused_loss_on
from meshforge.planning.theory import textbook_bubble


def bubble_fraction(schedule: str, p: int, m: int, v: int) -> float:
    """Idle fraction of a pipeline schedule: the textbook one (`theory.textbook_bubble`); the zero-bubble
    schedules fill most of it with the weight half of backward (counted as a third of it)."""
    frac = textbook_bubble(schedule, p, m, v)
    return frac / 3 if schedule in ("zero_bubble", "v_schedule") else frac


@dataclass
class StepTime:
    compute_s: float  # the slowest pipeline rank's compute per step (its micro batches and its optimizer step)
    parts: dict[str, float]  # that rank's compute by kind (seconds, compute_scale applied), and its host time
    comm: dict[tuple[str, str], float]  # seconds per (axis, kind) of rank 0, one collective after another
    exposed_s: float  # communication that adds to the step (of the slowest pipeline rank)
    bubble: float
    idle_s: float  # pipeline idle time (the bubble)
    step_s: float
    per_pp_rank: list[float] = field(default_factory=list)  # compute of each pipeline rank

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def busy_s(self) -> float:
        """The step less the pipeline's idle time: what the device is busy for (on CPU, the CPU time)."""
        return self.step_s - self.idle_s


def step_time(params: list[ParamRec], args, cfg, layout: Layout, pplan, device: Device, eff: Efficiency,
              comm_of, gpus_per_node: int, rank_parts: dict[int, object]) -> StepTime:
    """The step time of `cfg` (see the module docstring); `comm_of(pp_rank)` gives the bytes one rank of that
    pipeline rank hands to collectives (asked of the first and the busiest pipeline rank; the others are taken to
    send as the first does), `rank_parts` maps each pipeline rank to the largest state (`terms.Parts`) one
    of its ranks holds, for the optimizer's traffic. Every block has one block's shapes
    (the planner's model description), so a stage costs its block count times one block, plus its ends."""
    t, d = cfg.training, cfg.distributed
    if pplan is not None:
        mbs, n_mb = pplan.microbatch_size, pplan.n_microbatches
    else:
        mbs = t.micro_batch_size
        n_mb = t.global_batch_size // layout.dp // mbs
    tokens = mbs * t.seq_len // layout.cp
    key = _Key(bf16_compute(cfg), d.ac_mode, d.sequence_parallel, layout.tp, layout.cp, layout.ep,
               t.seq_len, tokens, t.fp8.enabled, t.fp8.recipe, t.fp8.filter, fused_loss_on(cfg))
    per_rank, parts_of = [], []
    block = _block_seconds(params, args, key, device, eff)
    ends_of = functools.cache(lambda first, last: _end_seconds(args, key, device, eff, first, last))  # per step
    first = comm_of(0)
    gathered = any(kind == "all_gather" and axis in DP_AXES for (axis, kind) in first)  # parameters gathered
    # the data-parallel collectives' buffers are copied in and out once each (FSDP's copy-in/out, DDP's buckets)
    staged = sum(n for (axis, kind), n in first.items() if axis in DP_AXES and kind != "broadcast")
    for pp_rank in range(layout.pp):
        here = pplan.rank_stages(pp_rank) if pplan is not None else [0]
        total: dict[str, float] = {}
        units = 0
        for s in here:
            blocks = len(pplan.stage_layers[s]) if pplan is not None else args.n_layers
            ends = ends_of(s == 0, pplan is None or s == pplan.num_stages - 1)
            for kind in dict.fromkeys([*block, *ends]):  # in order (a set's order, and so the float sums, moved
                # with Python's hash seed: the printed parts and the step time's last digit differed run to run)
                total[kind] = total.get(kind, 0.0) + n_mb * (blocks * block.get(kind, 0.0) + ends.get(kind, 0.0))
            units += blocks + 1
        calls = 2 * n_mb * units if gathered else 0
        state = rank_parts.get(pp_rank)
        opt_bytes = 0 if state is None else 2 * state.params + state.grads + 2 * state.optimizer
        total["optimizer"] = opt_bytes / _mem_rate(device, eff)
        total["staging"] = 2 * staged / _mem_rate(device, eff)
        total = {k: v * eff.compute_scale for k, v in total.items()}
        device_s = sum(total.values())
        total["host"] = calls * eff.host_s_per_call
        per_rank.append(max(device_s, total["host"]) if eff.overlap else device_s + total["host"])
        parts_of.append(total)
    asked = {0, max(range(layout.pp), key=lambda r: per_rank[r])}
    secs_of = {r: {k: comm_seconds(k, n, layout, device, eff, gpus_per_node, _calls(k, pplan, layout))
                   for k, n in comm_of(r).items()} for r in asked}
    exposed = [_exposed(secs_of.get(r, secs_of[0]), c, eff) for r, c in enumerate(per_rank)]
    slow = max(range(layout.pp), key=lambda r: per_rank[r] + exposed[r])
    sched = max(c - parts["optimizer"] for c, parts in zip(per_rank, parts_of))
    bubble = 0.0
    if pplan is not None:
        bubble = bubble_fraction(pplan.schedule, layout.pp, pplan.n_microbatches, pplan.stages_per_rank)
    idle = sched * bubble / (1 - bubble)
    return StepTime(per_rank[slow], parts_of[slow], secs_of[0], exposed[slow], bubble, idle,
                    per_rank[slow] + exposed[slow] + idle, per_rank)


def _exposed(secs: dict[tuple[str, str], float], compute_s: float, eff: Efficiency) -> float:
    """Communication that adds to a rank's step: tensor/context/expert/pipeline traffic always, data-parallel
    traffic where compute does not hide it (all of it on a device that does not overlap them)."""
    critical = sum(sec for (a, _k), sec in secs.items() if a in ("tp", "cp", "ep", "pp"))
    hidden = sum(secs.values()) - critical
    return critical + (max(0.0, hidden - compute_s) if eff.overlap else hidden)


DP_AXES = ("dp", "dp_shard", "dp_shard_cp", "dp_replicate", "dp_cp", "ep_shard")


def _calls(key: tuple[str, str], pplan, layout: Layout) -> int:
    """Collective calls behind one (axis, kind) entry where the planner knows them (the pipeline's sends: one per
    micro batch, stage and direction); others are priced by their bytes alone."""
    if key == ("pp", "send_recv") and pplan is not None:
        return 2 * pplan.n_microbatches * pplan.stages_per_rank
    return 0


@dataclass(frozen=True)
class _Key:
    bf16: bool
    ac: str | None
    sp: bool
    tp: int
    cp: int
    ep: int
    seq_len: int
    tokens: int  # per micro batch on one rank (after CP)
    fp8: bool
    fp8_recipe: str
    fp8_filter: str
    fused_loss: bool


def _block_seconds(params: list[ParamRec], args, key: _Key, device: Device, eff: Efficiency) -> dict[str, float]:
    """Seconds of one micro batch through one block on one rank, forward and backward, by kind (memoised: the
    search prices hundreds of candidates over one parameter list)."""
    return memo("block_s", params, (args, key, device, eff), lambda: _block_seconds_of(params, args, key, device, eff))


def _block_seconds_of(params: list[ParamRec], args, key: _Key, device: Device, eff: Efficiency) -> dict[str, float]:
    e = 2 if key.bf16 else F32
    m = key.tokens
    gemm_fwd = gemm_bwd = 0.0
    for p, count in _weights(params):
        for rows, n, k, times in _matmuls(p, args, key, m):
            speed = eff.fp8_gemm_speedup if _fp8(p, key) else 1.0
            sec = count * times * gemm_seconds(rows, n, k, e, device, eff, speed)
            gemm_fwd += sec
            gemm_bwd += sec * (2 if p.trainable else 1)
    attn_fwd = m * _attention_forward_flops(args, key) / (device.peak_tflops * 1e12 *
                                                          eff.attention_fraction(key.seq_len))
    elem_fwd = m * _elementwise_elements(args, key) * e / _mem_rate(device, eff) / 3
    recompute = 0.0
    if key.ac == "full":
        recompute = gemm_fwd + attn_fwd + elem_fwd
    elif key.ac == "selective":
        recompute = elem_fwd
    if key.cp > 1:
        recompute += attn_fwd  # context parallelism recomputes the local attention forward in backward
    return {"matmul": gemm_fwd + gemm_bwd, "attention": 3 * attn_fwd, "elementwise": 3 * elem_fwd,
            "recompute": recompute}


@functools.lru_cache(maxsize=4096)
def _end_seconds(args, key: _Key, device: Device, eff: Efficiency, first: bool, last: bool) -> dict[str, float]:
    """Seconds of one micro batch through the model's ends a stage holds: the embedding (first), the final norm,
    the output head (vocabulary-parallel under TP) and the loss (last)."""
    e = 2 if key.bf16 else F32
    m = key.tokens
    out = {"matmul": 0.0, "elementwise": 0.0}
    if first:
        out["elementwise"] += m * 10 * args.dim * e / _mem_rate(device, eff)
    if last:
        out["matmul"] += 3 * gemm_seconds(m, math.ceil(args.vocab_size / key.tp), args.dim, e, device, eff)
        vocab = (15 if key.fused_loss else 10) * math.ceil(args.vocab_size / key.tp)
        out["elementwise"] += m * (20 * args.dim + vocab) * e / _mem_rate(device, eff)
    return out


def _weights(params: list[ParamRec]) -> list[tuple[ParamRec, int]]:
    """[(a weight of block 0, how many of its weights are alike)]."""
    def compute():
        kinds: dict = {}
        for p in params:
            if p.block != 0 or len(p.shape) < 2:
                continue
            k = (p.shape, p.tp_dim, p.expert, p.trainable, p.adapter)
            rep, n = kinds.get(k, (p, 0))
            kinds[k] = (rep, n + 1)
        return list(kinds.values())

    return memo("weights", params, (), compute)


def _matmuls(p: ParamRec, args, key: _Key, m: int) -> list[tuple[int, int, int, int]]:
    """(rows, out, in, how many) of the matmuls one weight takes part in per micro batch, forward."""
    s = list(p.shape)
    if p.tp_dim is not None:
        s[p.tp_dim] = math.ceil(s[p.tp_dim] / key.tp)
    if p.expert:  # stacked routed experts [experts, a, b]: each local expert takes its share of the routed tokens
        local = max(1, s[0] // key.ep)
        rows = max(1, round(m * key.ep * args.top_k / max(1, args.n_experts)))
        return [(rows, s[1], math.prod(s[2:]), local)]
    return [(m, s[0], math.prod(s[1:]), 1)]


def _fp8(p: ParamRec, key: _Key) -> bool:
    """Does training.fp8 convert this weight's linear (the blocks' linears, never experts or adapters)?"""
    if not key.fp8 or p.expert or p.adapter or len(p.shape) != 2:
        return False
    n, k = p.shape
    if n % 16 or k % 16:
        return False
    return key.fp8_filter == "all" or FP8_AUTO[key.fp8_recipe](n, k)


def gemm_seconds(m: int, n: int, k: int, elem: int, device: Device, eff: Efficiency, speedup: float = 1.0) -> float:
    """One (m x k) @ (k x n) matmul on the roofline with a fixed time per kernel."""
    flops = 2 * m * n * k / (device.peak_tflops * 1e12 * eff.gemm * speedup)
    traffic = elem * (m * k + k * n + m * n) / _mem_rate(device, eff)
    return eff.gemm_overhead_s + max(flops, traffic)


def _mem_rate(device: Device, eff: Efficiency) -> float:
    return device.mem_gbps * 1e9 * eff.memory


def _attention_forward_flops(args, key: _Key) -> float:
    """Per token and block, forward: scores and weighted sum over the causal half, heads split over tp."""
    return 2 * 2 * (args.n_heads / key.tp) * args.hd * key.seq_len / 2


def _elementwise_elements(args, key: _Key) -> float:
    """Elements read and written per token and block by the elementwise kernels, forward and backward (see the
    module docstring)."""
    dim = args.dim / (key.tp if key.sp else 1)
    qk = (args.n_heads + args.n_kv_heads) * args.hd / key.tp
    if args.is_moe:
        return 73 * dim + 23 * qk + 16 * (args.top_k + args.n_shared_experts) * args.moe_ffn_dim / key.tp + \
            8 * args.top_k * args.dim
    return 73 * dim + 23 * qk + 16 * args.ffn_dim / key.tp


def comm_seconds(key: tuple[str, str], n: int, layout: Layout, dev: Device, eff: Efficiency, gpus_per_node: int,
                 calls: int = 0) -> float:
    """Time of `n` full-buffer bytes of one collective kind on a ring: each rank sends (size-1)/size of the buffer
    for an all-gather, reduce-scatter or all-to-all, twice that for an all-reduce (a reduce-scatter followed by
    an all-gather); plus the per-call latency where the calls are known."""
    axis, kind = key
    size = _axis_size(axis, layout)
    passes = 2 if kind == "all_reduce" else 1
    link = _link_bytes_per_s(axis, layout, dev, gpus_per_node) * eff.comm
    return passes * n * (size - 1) / max(size, 1) / link + calls * eff.comm_latency_s


def _link_bytes_per_s(axis: str, layout: Layout, dev: Device, gpus_per_node: int) -> float:
    """Bandwidth of an axis: NVLink when its groups fit inside one node, the fabric otherwise."""
    span = {"tp": layout.tp, "cp": layout.cp * layout.tp, "dp_shard": layout.dp_shard * layout.cp * layout.tp,
            "dp_shard_cp": layout.dp_shard * layout.cp * layout.tp, "ep": layout.ep * layout.tp,
            "ep_shard": layout.world_size // layout.pp, "dp_cp": layout.world_size // layout.pp,
            "dp": layout.world_size // layout.pp, "dp_replicate": layout.world_size // layout.pp,
            "pp": layout.world_size}.get(axis, layout.world_size)
    return (dev.nvlink_gbps if span <= gpus_per_node else dev.fabric_gbps) * 1e9


def _axis_size(axis: str, layout: Layout) -> int:
    if axis == "pp":
        return 2
    return layout.size(axis)


def largest_state_per_pp_rank(ranks, layout: Layout) -> dict[int, object]:
    """{pp rank: the largest state one of its planned ranks holds} (ranks: [(rank, Parts, ...)])."""
    out: dict[int, object] = {}
    for r, parts, *_ in ranks:
        pp = layout.coords(r)[MeshAxis.PP]
        if pp not in out or parts.total > out[pp].total:
            out[pp] = parts
    return out


@functools.lru_cache(maxsize=64)
def flops_per_token(args, seq_len: int) -> float:
    """The model contract's FLOPs per token: a built-in model's closed form (models/shapes.py, what the model
    itself answers); an hf_model's from a one-block meta model scaled to the real depth (FLOPs are affine in the
    number of layers: the output head once, the rest per layer)."""
    from meshforge.models import shapes

    if not args.hf_model:
        return shapes.flops_per_token(args, seq_len)
    from meshforge.models import build_model, contract_of

    one = dataclasses.replace(args, n_layers=1)
    per_layer = contract_of(build_model(one, device="meta")).flops_per_token(seq_len) - _head_flops(one)
    return _head_flops(args) + args.n_layers * per_layer


def _head_flops(args) -> float:
    return 6 * args.dim * args.vocab_size
