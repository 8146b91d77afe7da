"""Activations: the bytes autograd saves for one micro batch on one rank (`activation_bytes`), and how many micro
batches a pipeline rank keeps alive at once (`alive_peak`, a replay of its schedule's forward/backward order).

Calibrated against saved-tensor hooks on CPU (tests/unit/test_plan.py, tests/parallel/test_plan_accuracy.py).
"""

from __future__ import annotations

import functools
import itertools

from meshforge.planning.layout import Layout
from meshforge.planning.pipeline_plan import SINGLE_STAGE
from meshforge.planning.params import F32
from meshforge.planning.precision import bf16_compute, compiled, fused_loss_on


def activation_bytes(args, cfg, layout: Layout, blocks: int, first: bool, last: bool,
                     micro_batch: int | None = None) -> dict[str, int]:
    """Bytes autograd saves for one micro batch on one rank: {"blocks", "embedding", "head", "total",
    "recompute"} ("recompute": the transient of one block recomputed in backward under checkpointing).

    Per token per block, with the Llama block's saved tensors (element size e, fp32 norms statistics):
      no checkpointing: 4*dim (block input and residual, kept by the norms; the two norms' outputs, kept by the
        projections) + 2 rsqrt + q, k, v and the attention output (2*(heads + kv_heads)*head_dim) + heads
        (softmax log-sum-exp) + 3*ffn (w1 and w3 outputs, kept by the fused SwiGLU; the product, kept by w2)
        [MoE: the shared experts' SwiGLU instead of the MLP's, and the routed experts' copies (`_routed_bytes`);
        QK-norm: q's and k's norms keep their inputs and an fp32 rstd per head]
      full: the block input (dim) only; the block is recomputed in backward.
      selective: the block input + the matmul and attention outputs it caches (q, k, v, attention output and
        log-sum-exp, o-proj, ffn gate and up, down; an MoE's routed experts run outside its cache, recomputed).
    TP divides heads and ffn by tp; sequence parallelism divides the norms' tensors too (without checkpointing
    the projections keep the sequence shard and gather it again in backward, distributed/tensor_parallel.py;
    recomputed blocks gather it in their recompute); CP divides the tokens.
    Head: the final norm (2*dim + 1), the fp32 log-softmax of the logits (vocab/tp per token; with the fused
    loss only its log-sum-exp, one fp32 per token: the logits are recomputed chunk by chunk), int64 labels.
    Measured against saved-tensor hooks on CPU: exact on one process, within 1% under TP/SP/CP.
    """
    d, t = cfg.distributed, cfg.training
    out = dict(_activation_bytes(args, bf16_compute(cfg), micro_batch or t.micro_batch_size,
                                 t.seq_len, layout.cp, layout.tp, d.sequence_parallel, d.ac_mode,
                                 fused_loss_on(cfg), blocks, first, last, lora_profile(cfg, args),
                                 compiled(cfg)))
    if args.hf_model:  # a transformers model's own blocks and final norm: measured (planning/hf_activations.py)
        from meshforge.planning.hf_activations import measured_activations

        out = measured_activations(out, args, cfg, layout, micro_batch or t.micro_batch_size)
    return out


LORA_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_profile(cfg, args) -> tuple | None:
    """(adapted roles, norms trainable, embedding trainable, rank) of a LoRA run on a dense model whose adapter
    roles are the Llama block's; None otherwise (then activations are counted as for full training, and the
    plan says so)."""
    if cfg.peft is None or args.is_moe:
        return None
    key = (cfg.model.model_dump_json(), tuple(cfg.peft.target_modules))
    if key not in _ROLES:
        from meshforge.models import plan_modules
        from meshforge.models.shapes import layout_of, resolve_roles

        _ROLES[key] = frozenset(resolve_roles(layout_of(plan_modules(cfg.model)[0]), list(cfg.peft.target_modules)))
    roles = _ROLES[key]
    if not roles <= set(LORA_ROLES):
        return None
    return roles, "norms" not in cfg.peft.freeze, "embeddings" not in cfg.peft.freeze, cfg.peft.rank


_ROLES: dict = {}


def _routed_bytes(args, e: int) -> int:
    """Bytes per token an MoE's routed experts keep without checkpointing (measured with saved-tensor hooks, one
    process, tiny MoE shapes within 0.5%): per routed copy (top_k per token) the gathered input and the experts'
    output (and its weighted copy), dim each, the grouped matmuls' gate and up outputs and their product, moe_ffn
    each, the copy's weight (fp32) and three int64 indices (expert, token, order); per token the router's fp32
    scores. Every tp rank computes the routed experts on the whole sequence (sequence parallelism gathers it
    around them), so these are per token of the sequence the rank's MoE sees; under EP a rank's experts keep what
    the routing sends them (this is the balanced count)."""
    return args.top_k * ((3 * args.dim + 3 * args.moe_ffn_dim) * e + F32 + 3 * 8) + args.n_experts * F32


@functools.lru_cache(maxsize=8192)
def _activation_bytes(args, bf16: bool, micro_batch: int, seq_len: int, cp: int, tp: int, sequence_parallel: bool,
                      mode: str | None, fused: bool, blocks: int, first: bool, last: bool,
                      lora: tuple | None = None, compiled: bool = False) -> dict[str, int]:
    e = 2 if bf16 else F32
    tokens = micro_batch * seq_len // cp
    sp = tp if sequence_parallel else 1
    hd, h, kv = args.hd, args.n_heads // tp, args.n_kv_heads // tp
    ffn = args.ffn_dim // tp
    routed = 0  # bytes per token an MoE's routed experts keep (not split by TP)
    if args.is_moe:
        ffn = args.n_shared_experts * args.moe_ffn_dim // tp  # the shared experts: a SwiGLU split like Llama's
        routed = _routed_bytes(args, e)
    dim_full = args.dim
    dim_sp = args.dim // sp
    attn = 2 * (h + kv) * hd  # q, k, v, attention output
    mm = 3 * ffn
    # QK-norm (Qwen3): each of q's and k's norms keeps its input (the projection's output) and an fp32 rstd per head
    qk = (h + kv) * (hd * e + F32) if getattr(args, "qk_norm", False) else 0
    if mode is None:
        per_tok = (4 * dim_sp + attn + mm) * e + (2 + h) * F32 + routed + qk
        if compiled and sp > 1:  # compiled blocks keep each sub-layer's gathered input whole (measured, CPU)
            per_tok += 2 * (dim_full - dim_sp) * e
    elif mode == "full":
        per_tok = dim_sp * e
    else:
        # o-proj's output, and the down projection's where a dense one runs (an MoE's routed experts run outside
        # the cache: distributed/expert_parallel.py)
        per_tok = (dim_sp + attn + dim_full + (dim_full if ffn else 0) + 2 * ffn) * e + h * F32
    full_block = (4 * dim_sp + attn + mm) * e + (2 + h) * F32 + routed + qk
    first_block = 0  # LoRA: what block 0 does not keep
    emb_train = lora is None or lora[2]  # the embedding and the output head (LoRA freezes both by default)
    if lora is not None:
        # autograd keeps only what the gradients of inputs that require one need (measured, one process):
        # a frozen projection keeps no input (its group keeps it if any member is adapted: LoRA's A reads it);
        # each adapter adds its rank-r A output (selective checkpointing caches every matmul output, the
        # adapters' B outputs too); with the embedding and the norms frozen, block 0's first norm is not in the
        # graph at all (a norm keeps its input and rsqrt whenever either needs a gradient)
        roles, norms_train, _, r = lora
        out_features = {"q_proj": args.n_heads * hd // tp, "k_proj": args.n_kv_heads * hd // tp,
                        "v_proj": args.n_kv_heads * hd // tp, "o_proj": dim_full, "gate_proj": ffn,
                        "up_proj": ffn, "down_proj": dim_full}
        kept = len(roles) * r * e
        kept -= 0 if roles & {"q_proj", "k_proj", "v_proj"} else dim_sp * e
        kept -= 0 if roles & {"gate_proj", "up_proj"} else dim_sp * e
        kept -= 0 if "down_proj" in roles else ffn * e
        full_block += kept
        if mode is None:
            per_tok += kept
            first_block = 0 if emb_train or norms_train else dim_sp * e + F32
        elif mode == "selective":
            per_tok += sum(r + out_features[role] for role in roles) * e
    rope = 2 * (seq_len // cp) * (hd // 2) * F32 if blocks else 0  # cos/sin of this rank's positions
    out = {"blocks": blocks * per_tok * tokens + rope - (first_block * tokens if first and blocks else 0),
           # int64 token ids, for the embedding's gradient (none when it is frozen)
           "embedding": tokens * 8 if first and emb_train else 0,
           # the final norm's input and rsqrt; the head's input (gathered along the sequence under SP), which a
           # frozen head (LoRA) keeps only for the fused loss's recomputation; the loss's fp32 log-softmax and
           # int64 labels, or the fused loss's log-sum-exp
           "head": (tokens * ((dim_sp + (dim_full if fused or emb_train else 0)) * e + F32
                              + (F32 if fused else (args.vocab_size // tp) * F32) + 8)
                    + (0 if fused else F32))
           if last else 0,
           "recompute": full_block * tokens if mode and blocks else 0}
    out["total"] = out["blocks"] + out["embedding"] + out["head"]
    return out



def loss_backward_bytes(args, cfg, layout: Layout, micro_batch: int | None = None) -> int:
    """Bytes the loss's backward allocates on top of what is alive (the last stage's rank), at its worst moment.

    Fused loss (`models/loss.py` `_ChunkedCE.backward`, per chunk of C = 2^28 / vocab tokens): the gradient of the
    hidden states (tokens x dim, their dtype) and of the head's weight (vocab x dim, fp32, accumulated over the
    chunks) for the whole backward; per chunk the fp32 logits (turned into their gradient in place), their cast
    to the compute dtype, and the chunk's contribution to the weight's gradient (vocab x dim, compute dtype)
    before it is added (the hidden chunk's cast too when the hidden states are in another dtype). Measured with
    the scale trace at Llama 3 8B shapes: exact.
    Plain loss (`F.cross_entropy` on fp32 logits, vocabulary-parallel under TP): the logits and the gradients of
    their fp32 copy (measured with the scale trace: exact)."""
    from meshforge.planning.precision import residual_bytes

    t = cfg.training
    tokens = (micro_batch or t.micro_batch_size) * t.seq_len // layout.cp
    e = 2 if bf16_compute(cfg) else F32
    lora = lora_profile(cfg, args)
    head_trains = lora is None or lora[2]
    if not fused_loss_on(cfg):
        # the logits (compute dtype, held by the step until the backward ends) and the fp32 gradients: through
        # nll_loss and log_softmax (two at once), or loss_parallel's fused backward under TP (three: its zeros, the
        # exponentials, their sum)
        return tokens * (args.vocab_size // layout.tp) * (e + (3 if layout.tp > 1 else 2) * F32)
    # under TP the vocabulary-parallel loss (distributed/vocab_parallel_loss.py): this rank's rows of the head only
    v, d = -(-args.vocab_size // layout.tp), args.dim
    eh = residual_bytes(cfg, layout)
    chunk = min(tokens, max(1, 2**28 // v))
    out = tokens * d * eh + (chunk * d * e if eh != e else 0)
    if layout.tp == 1:  # the chunk's fp32 logits stay alive beside their cast (models/loss.py)
        return out + chunk * v * (F32 + e) + (v * d * (F32 + e) if head_trains else 0)
    # the vocabulary-parallel backward drops a chunk's fp32 gradient once cast: the weight's gradient product
    # meets only the cast (measured with the scale trace at Llama 3 8B shapes, TP 2: exact)
    if not head_trains:
        return out + chunk * v * (F32 + e)
    return out + v * d * F32 + max(chunk * v * (F32 + e), chunk * v * e + v * d * e)


def embedding_backward_bytes(args, cfg, layout: Layout, micro_batch: int | None = None) -> int:
    """Bytes the embedding's backward allocates on a pipeline's first stage, on top of what is alive: its weight's
    gradient for the micro batch (the dtype the weight is computed in: bf16 gathered, fp32 where autocast runs over
    fp32 parameters, TP + PP without data parallelism; the whole vocabulary x dim under TP, where it arrives
    Replicate),
    and under sequence parallelism the all-gathered gradient of its output. Measured with the scale trace
    (Llama 3 70B shapes, TP 8 x PP 4): within 2%, the micro batch's own activations being partly freed by then."""
    from meshforge.planning.precision import residual_bytes

    lora = lora_profile(cfg, args)
    if lora is not None and not lora[2]:
        return 0
    t = cfg.training
    tokens = (micro_batch or t.micro_batch_size) * t.seq_len // layout.cp
    grad = args.vocab_size * args.dim * residual_bytes(cfg, layout)
    if layout.tp == 1:
        return grad
    sp = tokens * args.dim * residual_bytes(cfg, layout) if cfg.distributed.sequence_parallel else 0
    return grad + sp


@functools.lru_cache(maxsize=4096)
def rank_passes(schedule: str, p: int, r: int, m: int, v: int) -> tuple[tuple[str, int], ...] | None:
    """The forwards ("F") and backwards ("B") pp rank `r` runs in one schedule step, in order, each with the local
    stage it runs (torch's schedules, as `alive_peak` replays them); None for v_schedule (not replayed)."""
    if schedule == "gpipe":
        return (("F", 0),) * m + (("B", 0),) * m
    if schedule == "looped_bfs":  # every micro batch through a stage before the next stage; backward in reverse
        return tuple(("F", s) for s in range(v) for _ in range(m)) + \
            tuple(("B", s) for s in reversed(range(v)) for _ in range(m))
    if schedule == "v_schedule":
        return None
    total = m * v
    if v == 1:
        warmup = min(m, p - 1 - r)
        per_round = m
    else:
        per_round = m // max(1, m // p)
        warmup = min(total, (v - 1) * per_round + (1 if schedule == "zero_bubble" else 2) * (p - 1 - r))
    out, f, b = [], 0, 0
    for op in ["F"] * warmup + ["F", "B"] * (total - warmup) + ["B"] * warmup:
        if op == "F":
            out.append(("F", (f // per_round) % v))
            f += 1
        else:
            out.append(("B", v - 1 - ((b // per_round) % v)))
            b += 1
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def alive_at_backward(schedule: str, p: int, r: int, m: int, weights: tuple[int, ...], stage: int) -> int:
    """The most activation bytes pp rank `r` keeps when a backward of its local `stage` starts (that micro batch
    still alive), replaying the order `alive_peak` replays: the moment of the loss's backward on the last stage
    and of the embedding's on the first, which under an interleaved schedule need not be the schedule's peak
    (rank 1 of 2, 4 micro batches: the third micro batch of its first stage is alive only in the forward before
    its first stage's backwards, when its last stage holds none). The schedule's peak where it is not replayed
    (v_schedule) or a backward keeps its graph longer (zero_bubble's weight passes)."""
    passes = rank_passes(schedule, p, r, m, len(weights))
    if passes is None or schedule == "zero_bubble":
        return alive_peak(schedule, p, r, m, weights)[0]
    now = worst = 0
    for op, s in passes:
        if op == "F":
            now += weights[s]
            continue
        if s == stage:
            worst = max(worst, now)
        now -= weights[s]
    return worst


MAX_ACTIVE_STAGES = 3  # torch's multi-stage schedules keep at most 3 stages unsharded (`_add_unshard_reshard`)


@functools.lru_cache(maxsize=4096)
def lowered_passes(schedule: str, p: int, r: int, m: int, v: int) -> tuple[tuple[str, int], ...] | None:
    """`rank_passes` with what torch's multi-stage schedules (`_PipelineScheduleRuntime`, torch 2.13) insert
    for FSDP: before each compute action the next MAX_ACTIVE_STAGES stages to run are unsharded ("U") and the
    others resharded ("R"), so no more than that many stages hold gathered parameters at once; a single-stage
    schedule inserts nothing (its stage stays gathered through the step)."""
    passes = rank_passes(schedule, p, r, m, v)
    if passes is None or schedule in SINGLE_STAGE:
        return passes
    # the next MAX_ACTIVE_STAGES stages to run from each action on (in the order they next run): from the end
    # backwards, so the whole schedule is read once (a long schedule has thousands); the stage of the action
    # read runs next of all, so it moves to the front of the stages ordered by their next action
    upcoming_at, by_next = [], []
    for i in range(len(passes) - 1, -1, -1):
        s = passes[i][1]
        if s in by_next:
            by_next.remove(s)
        by_next.insert(0, s)
        upcoming_at.append(by_next[:MAX_ACTIVE_STAGES])
    upcoming_at.reverse()
    out, active = [], []
    for action, upcoming in zip(passes, upcoming_at):
        if active == upcoming:  # (the steady state: nothing to reshard or unshard)
            out.append(action)
            continue
        for s in [s for s in active if s not in upcoming]:
            active.remove(s)
            out.append(("R", s))
        for s in [s for s in upcoming if s not in active]:
            active.append(s)
            out.append(("U", s))
        out.append(action)
    return tuple(out)


def gathered_sets(lowered: tuple[tuple[str, int], ...], v: int) -> list[frozenset]:
    """The sets of local stages unsharded at once over a lowered schedule (all `v` when nothing reshards)."""
    if not any(op == "U" for op, _ in lowered):
        return [frozenset(range(v))]
    out, active = set(), set()
    for op, s in lowered:
        if op == "U":
            active.add(s)
            out.add(frozenset(active))
        elif op == "R":
            active.discard(s)
    return sorted(out, key=len)


@functools.lru_cache(maxsize=4096)
def schedule_gathered_sets(schedule: str, p: int, r: int, m: int, v: int, n_stages: int) -> tuple[frozenset, ...]:
    """`gathered_sets` of pp rank `r`'s lowered schedule (all `n_stages` at once where it is not replayed)."""
    lowered = lowered_passes(schedule, p, r, m, v)
    return tuple(gathered_sets(lowered, n_stages)) if lowered is not None else (frozenset(range(n_stages)),)


@functools.lru_cache(maxsize=4096)
def alive_peak(schedule: str, p: int, r: int, m: int, weights: tuple[int, ...]) -> tuple[int, int]:
    """(peak bytes, stage-microbatches alive then) of the activations pp rank `r` keeps, replaying the order in
    which torch's schedule runs its forwards (F) and backwards (B); `weights` are the bytes one micro batch keeps
    on each local stage, in order. A stage's micro batch is alive from its F to its B (zero_bubble: to its
    weight pass)."""
    v = len(weights)
    if schedule in ("gpipe", "looped_bfs"):  # every forward before any backward
        return m * sum(weights), m * v
    if schedule == "v_schedule":  # ScheduleZBVZeroBubble: 2(p-r)-1 forwards on chunk 0, r on each chunk, one more
        n0, n1 = min(m, 2 * p - r - 1), min(m, r + 1)
        return n0 * weights[0] + n1 * weights[1], n0 + n1
    events = _alive_events(schedule, p, r, m, v)  # a forward on local stage s: s; a freeing backward: ~s
    delta = list(weights) + [-w for w in reversed(weights)]  # delta[s] = weights[s], delta[~s] = -weights[s]
    alive = list(itertools.accumulate(map(delta.__getitem__, events)))
    peak = max(alive, default=0)
    if peak <= 0:
        return 0, 0
    # first reached at a forward (a backward never adds); the micro batches alive then: forwards less backwards
    first = alive.index(peak) + 1
    return peak, 2 * sum(map((0).__le__, events[:first])) - first


@functools.lru_cache(maxsize=4096)
def _alive_events(schedule: str, p: int, r: int, m: int, v: int) -> tuple[int, ...]:
    """The replay of `alive_peak`, its weights apart (a search asks it for many weights of one schedule): the
    local stage s of each forward, ~s of the stage each freeing backward frees, in order."""
    total = m * v
    if v == 1:  # Schedule1F1B: p - 1 - r warm-up forwards
        warmup = min(m, p - 1 - r)
        f_stage = b_stage = lambda k: 0  # noqa: E731
    else:  # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (`_get_warmup_ops` and their stage order)
        per_round = m // max(1, m // p)
        hop = 1 if schedule == "zero_bubble" else 2
        warmup = min(total, (v - 1) * per_round + hop * (p - 1 - r))

        def f_stage(k):
            return (k // per_round) % v

        def b_stage(k):
            return v - 1 - ((k - warmup) // per_round) % v
    # zero_bubble: torch keeps a micro batch's graph from its forward to its weight pass (W), which on pp rank r
    # runs r backward passes after its input-gradient pass (`_get_1f1b_rank_ops`), the rest at the end
    lag = r if schedule == "zero_bubble" else 0
    out, f, b = [], 0, 0
    pending: list[int] = []
    for op in ["F"] * warmup + ["F", "B"] * (total - warmup) + ["B"] * warmup:
        if op == "F":
            out.append(f_stage(f))
            f += 1
            continue
        pending.append(b_stage(warmup + b))
        if b >= lag:
            out.append(~pending.pop(0))
        b += 1
    return tuple(out)
