"""Bytes one rank hands to collectives per optimizer step, per (mesh axis, collective kind): `comm_per_step`.

Counted as the bench counts them (the full-buffer side: all-gather output, reduce-scatter input, all-reduce
tensor, all-to-all input, p2p tensor), in the order a step issues them:
  data parallel   the strategy's own collectives (its spec's planner terms, `planning/terms.py`)
  tensor          per micro batch, what torch's DTensor styles move (`_tensor_parallel`)
  scalars         the loss and its token count over dp*cp; the gradient norm (`_grad_norm`); MoE expert loads
                  (auxiliary-loss-free balancing)
  pipeline        activations and their gradients between stages, the loss broadcast, the norms' sum
  expert          each token's routed copies there and back (`_expert_parallel`)
  context         K/V gathered and their gradients reduce-scattered per attention layer (`_context_parallel`)
"""

from __future__ import annotations

import functools
import math

from meshforge.planning.activations import lowered_passes
from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.params import F32, ParamRec, chunk_rows, local_shape, replicate_grad
from meshforge.planning.precision import FLOAT8_TP_AMAX, bf16_compute, float8_weights, fused_loss_on, residual_bytes
from meshforge.planning.state import pipeline_plan_of, stage_params, terms_of
from meshforge.planning.terms import AddComm


def comm_per_step(params: list[ParamRec], args, cfg, layout: Layout, rank: int = 0) -> dict[tuple[str, str], int]:
    """{(axis, kind): bytes} one rank hands to collectives per optimizer step (see the module docstring)."""
    t = cfg.training
    c = layout.coords(rank)
    out: dict[tuple[str, str], int] = {}

    def add(axis, kind, n):
        if n:
            out[(axis, kind)] = out.get((axis, kind), 0) + int(n)

    n_micro = t.global_batch_size // layout.dp // t.micro_batch_size
    accum = 1 if layout.pp > 1 else n_micro
    micro = t.micro_batch_size
    if layout.pp > 1:  # the pipeline's microbatches carry the per-microbatch traffic
        pplan = pipeline_plan_of(cfg, layout, args.n_layers)
        n_micro, micro = pplan.n_microbatches, pplan.microbatch_size
    stages = stage_params(params, cfg, layout, c[MeshAxis.PP], args.n_layers)
    terms = terms_of(cfg)
    passes = _stage_passes(cfg, layout, c[MeshAxis.PP], args.n_layers, len(stages))
    for i, stage in enumerate(stages):
        terms.comm(stage, cfg, layout, accum, add, passes[i])
    mine = [p for st in stages for p in st]
    if layout.tp > 1:
        _tensor_parallel(mine, args, cfg, layout, n_micro, micro, add)
    # scalars: the loss averaged over the data-parallel ranks and its label-token count
    if layout.world_size > 1 and layout.size("dp_cp") > 1:
        add("dp_cp", "all_reduce", F32)
        add("dp_cp", "all_reduce", 8)  # the global count of label tokens (int64) that normalises the loss
    _grad_norm(mine, terms, cfg, layout, add)
    if layout.pp > 1:
        _pipeline(params, terms, args, cfg, layout, c, add)
    if layout.ep > 1 and args.is_moe:
        _expert_parallel(mine, args, cfg, layout, n_micro, micro, add)
    if args.router_bias_update_rate > 0 and layout.world_size > 1 and layout.size("dp_cp") > 1:
        # auxiliary-loss-free balancing: the step's int64 expert loads of this rank's MoE layers, one all-reduce
        add("dp_cp", "all_reduce", len({p.block for p in mine if p.expert}) * args.n_experts * 8)
    if layout.cp > 1:
        _context_parallel(mine, args, cfg, layout, n_micro, micro, add)
    return out


def _pipeline(params: list[ParamRec], terms, args, cfg, layout: Layout, c: dict, add: AddComm) -> None:
    """Per microbatch, each local stage sends its output to the next stage and its input's gradient to the previous
    one and receives their counterparts (p2p with a stage on another pp rank; a V's turn on one rank passes
    tensors directly); per step the loss broadcast, the stages' squared norms, and the gradient sum of weights
    tied across the first and the last stage (the local shards of both ends, on those two pp ranks)."""
    t = cfg.training
    pplan = pipeline_plan_of(cfg, layout, args.n_layers)
    e = residual_bytes(cfg, layout)  # the hidden states a stage hands on
    act = (pplan.microbatch_size * t.seq_len // layout.cp * args.dim
           // (layout.tp if cfg.distributed.sequence_parallel else 1))
    r = c[MeshAxis.PP]
    links = sum(1 for s in pplan.rank_stages(r) for nb in (s - 1, s + 1)
                if 0 <= nb < pplan.num_stages and pplan.stage_rank(nb) != r)
    add("pp", "send_recv", 2 * pplan.n_microbatches * act * e * links)
    add("pp", "broadcast", F32)  # the last stage's loss to the other stages
    add("pp", "all_reduce", F32)  # the stages' squared gradient norms
    ends = (pplan.stage_rank(0), pplan.last_stage_rank)
    if ends[0] != ends[1] and r in ends:
        shard = c[MeshAxis.DP_SHARD_CP] if terms.dtensor_grads(cfg, layout) else None
        add("pp", "all_reduce", F32 * sum(_grad_piece(p, layout, shard) for p in params if p.tied_copy and p.trainable))


def _grad_piece(p: ParamRec, layout: Layout, shard: int | None) -> int:
    """Elements of the local gradient of `p` on this rank: the torch.chunk piece of the data-parallel shard
    `shard` (gradients that are DTensors over the dp mesh), else the whole local (TP) tensor."""
    shape = local_shape(p, layout)
    if shard is None:
        return math.prod(shape)
    return chunk_rows(shape[0], layout.dp_shard * layout.cp, shard) * (math.prod(shape) // shape[0] if shape[0] else 0)


def _stage_passes(cfg, layout: Layout, pp_rank: int, n_layers: int, n_stages: int) -> list[list[str] | None]:
    """Each local stage's forwards ("F"), backwards ("B"), unshards ("U") and reshards ("R") in the schedule's order
    (None without PP or where not replayed)."""
    if layout.pp == 1:
        return [None] * n_stages
    pplan = pipeline_plan_of(cfg, layout, n_layers)
    return list(_split_passes(pplan.schedule, layout.pp, pp_rank, pplan.n_microbatches, pplan.stages_per_rank,
                              n_stages))


@functools.lru_cache(maxsize=4096)
def _split_passes(schedule: str, p: int, r: int, m: int, v: int, n_stages: int) -> tuple:
    seq = lowered_passes(schedule, p, r, m, v)
    if seq is None:
        return (None,) * n_stages
    return tuple(tuple(op for op, s in seq if s == i) for i in range(n_stages))


def _grad_norm(mine: list[ParamRec], terms, cfg, layout: Layout, add: AddComm) -> None:
    """One 4-byte all-reduce per DTensor gradient and mesh dimension it is sharded over (the strategy says whether
    its gradients are DTensors over the dp mesh), and the strategy's own reductions."""
    dtensor = terms.dtensor_grads(cfg, layout)
    n_ep = n_dp = n_tp = 0
    for p in (p for p in mine if p.trainable and not p.copy):  # a tied copy is not counted (pipeline_ties.py)
        if p.expert and layout.ep > 1:
            n_ep += 1
            continue
        n_dp += dtensor
        n_tp += layout.tp > 1 and p.tp_dim is not None and (dtensor or not replicate_grad(p))
    add("ep", "all_reduce", n_ep * F32)
    add("ep_shard", "all_reduce", n_ep * F32 * (dtensor and layout.size(MeshAxis.EP_SHARD) > 1))
    add("dp_shard_cp", "all_reduce", n_dp * F32)  # the sharded mesh dimension (HSDP's replicas hold the same)
    add("tp", "all_reduce", n_tp * F32)
    terms.norm_comm(cfg, layout, add)


def _tensor_parallel(mine_all: list[ParamRec], args, cfg, layout: Layout, n_micro: int, micro: int,
                     add: AddComm) -> None:
    """Per micro batch (measured on torch's DTensor styles). Without sequence parallelism: an all-reduce of the
    activations (tokens x dim) after each row-wise projection and the vocabulary-parallel embedding (forward), of
    the input gradient of each column-wise projection and of the output head (backward). With it, each sub-layer
    all-gathers its sequence-sharded input and reduce-scatters its output (forward), the output's gradient is
    all-gathered (backward) and each column-wise projection all-reduces its input gradient as without it; the
    embedding reduce-scatters (forward) and the head all-gathers (forward), each with its mirror in backward;
    without checkpointing each sub-layer gathers its kept sequence shard again in backward
    (distributed/tensor_parallel.py). Checkpointing (full or selective) runs the block's forward collectives
    again, except the last reduction of each block: the recomputation stops at the last tensor backward needs
    (non-reentrant checkpoint), and the block's output is not one. The vocabulary-parallel loss reduces the max,
    sum of exponentials and target logit of every token (3 x tokens x 4 bytes); the fused loss instead all-gathers
    two fp32 numbers a token (each rank's log-sum-exp and label logit, distributed/vocab_parallel_loss.py), and
    gathers (SP) or all-reduces the head's input and its gradient as the head would."""
    d, t = cfg.distributed, cfg.training
    e = 2 if bf16_compute(cfg) else F32
    tokens = micro * t.seq_len // layout.cp
    act = tokens * args.dim * e
    mine = [p for p in mine_all if p.tp_dim is not None and not p.adapter]
    in_blocks = [p for p in mine if p.block is not None]
    # projection weights (not their biases, nor per-head parameters such as attention sinks)
    projections = [p for p in in_blocks if len(p.shape) == 2]
    rows = sum(1 for p in projections if p.tp_dim == 1)  # row-wise: one per sub-layer
    n_blocks = len({p.block for p in in_blocks})

    # the residual stream's dtype (fp32 where autocast runs over fp32 parameters: TP + PP without data
    # parallelism): the vocabulary-parallel embedding's output, the norms' outputs the sub-layers gather under SP
    # and the column-wise projections' input gradients (autocast casts them back to their input's dtype) are in
    # it; the row-wise outputs and their gradients in the compute dtype
    er = residual_bytes(cfg, layout)
    emb = tokens * args.dim * er

    def input_grad(p: ParamRec) -> int:  # a column-wise projection's input gradient (its weight's in-features)
        return tokens * p.shape[1] * er
    first = any(p.place == "first" for p in mine)
    # the output head, or (without PP) the embedding tied to it; under PP the last stage holds the tied copy
    head = any(p.place == "last" or (p.tied_copy and layout.pp == 1) for p in mine)
    # a frozen embedding (and frozen norms in the first block) needs no gradient of its output: backward skips the
    # embedding's mirror collective and the input gradients of the first sub-layer's column-wise projections
    # (those before the first block's first row-wise one)
    frozen_in = first and not any(p.trainable for p in mine_all if p.place == "first" or
                                  (p.block == 0 and len(p.shape) == 1))
    skip = 0
    if frozen_in:
        for p in (p for p in projections if p.block == 0):
            if p.tp_dim == 1:
                break
            skip += input_grad(p)
    # column-wise projections' input gradients, and the inputs the plan declares shared by the ranks' heads
    cols = sum(input_grad(p) for p in projections if p.tp_dim == 0) - skip + _shared_inputs(mine_all, cfg) * tokens * e
    recompute = d.ac_mode is not None
    fused = fused_loss_on(cfg)
    loss = 3 * tokens * F32 if head and not fused else 0
    if head and fused:
        add("tp", "all_gather", n_micro * layout.tp * 2 * tokens * F32)
    # replicated parameters with Partial gradients are all-reduced twice per step, by the gradient norm and by the
    # optimizer step (measured, torch 2.13, dp 1)
    # (once when the strategy's gradients are DTensors over the data-parallel mesh too: measured with the scale trace)
    partial = (1 if terms_of(cfg).dtensor_grads(cfg, layout) else 2) * F32 * sum(
        math.prod(p.shape) for p in mine_all if p.partial_grad and p.trainable)
    summed, gathered = transformers_styles_comm(mine_all, cfg, layout, n_micro)
    summed += n_micro * _float8_amaxes(projections, mine_all, cfg, recompute) * FLOAT8_TP_AMAX
    if gathered:
        add("tp", "all_gather", gathered)
    if d.sequence_parallel:
        g, regather = _gathered_sublayers(mine_all, projections, recompute)
        whole = sum(1 for p in projections if p.whole_out)  # all-reduced whole (an MoE's shared experts), not scattered
        # a sub-layer's input (the norm's output, residual dtype) gathered in forward, recomputation and again in
        # backward; its output's gradient (compute dtype) in backward
        add("tp", "all_gather", n_micro * ((g + head) * act + (g + (g if recompute else 0) + regather) * emb
                                           + (first - frozen_in) * emb))
        add("tp", "reduce_scatter",
            n_micro * ((rows - whole + head + (rows - n_blocks if recompute else 0)) * act + first * emb))
        add("tp", "all_reduce", n_micro * (whole * act + cols + loss) + partial + summed)
    else:
        redo = rows - n_blocks if recompute else 0
        if recompute and args.hf_model:  # a block keeping its last reduction's output recomputes that one too
            from meshforge.planning.hf_activations import recomputed_last_reductions

            redo += recomputed_last_reductions(cfg, layout.tp, micro)
        add("tp", "all_reduce", n_micro * ((rows + head + redo) * act + first * emb + cols + loss) + partial + summed)


def _float8_amaxes(projections: list[ParamRec], mine_all: list[ParamRec], cfg, recompute: bool) -> int:
    """training.fp8 under TP: the amax all-reduces of one micro batch. Each cast of a tensor sharded over tp reduces
    its amax (torchao's float8 styles, distributed/float8.py): every float8 weight in forward and again in
    backward (torchao keeps the high-precision weight and casts it again), a row-wise projection's input (split on
    its in-features) in forward, a column-wise one's output gradient in backward; checkpointing casts the forward's
    again (measured with the scale trace, torch 2.13, torchao 0.18)."""
    names = float8_weights(mine_all, cfg)
    f8 = [p for p in projections if p.name in names]
    forward = len(f8) + sum(p.tp_dim == 1 for p in f8)
    return forward * (2 if recompute else 1) + len(f8) + sum(p.tp_dim == 0 for p in f8)


def transformers_styles_comm(mine_all: list[ParamRec], cfg, layout: Layout, n_micro: int) -> tuple[int, int]:
    """(all-reduced, all-gathered) bytes a step of transformers' own TP styles (a model.hf_model's plan,
    distributed/tensor_parallel.py; measured, torch 2.13): a `replicate_grad_sum` parameter's gradient is
    all-reduced in backward at every micro batch, in the dtype the forward used it in; a `colwise_gather`
    projection all-gathers its whole output in forward (again when checkpointing recomputes it), a `rowwise_split`
    one its input's whole gradient in backward."""
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len // layout.cp
    e = 2 if bf16_compute(cfg) else F32
    summed = n_micro * residual_bytes(cfg, layout) * sum(math.prod(p.shape) for p in mine_all
                                                         if p.tp_style == "replicate_grad_sum" and p.trainable)
    weights = [p for p in mine_all if len(p.shape) == 2 and not p.adapter]
    again = 2 if cfg.distributed.ac_mode is not None else 1
    gathered = n_micro * tokens * e * (again * sum(p.shape[0] for p in weights if p.tp_style == "colwise_gather")
                                       + sum(p.shape[1] for p in weights if p.tp_style == "rowwise_split"))
    return summed, gathered


def _shared_inputs(mine: list[ParamRec], cfg) -> int:
    """Per token, the summed widths of the `shared_input` modules (DeepSeek's shared rope key) in this rank's blocks:
    each all-reduces its input gradient over tp in backward (distributed/tensor_parallel.py)."""
    blocks = {p.block for p in mine if p.block is not None}
    widths = _shared_input_widths(cfg.model.model_dump_json(), cfg.distributed.sequence_parallel)
    return sum(w for block, w in widths if block in blocks)


_SHARED: dict = {}


def _shared_input_widths(model_json: str, sequence_parallel: bool) -> tuple[tuple[int, int], ...]:
    """((block, width), ...) of the model's `shared_input` modules (their description's `init` is the width)."""
    key = (model_json, sequence_parallel)
    if key not in _SHARED:
        from meshforge.config.schema import ModelConfig
        from meshforge.models import plan_modules
        from meshforge.planning.tp_plan import resolve_plan

        one, modules = plan_modules(ModelConfig.model_validate_json(model_json))
        styles, _, _ = resolve_plan(one, sequence_parallel, None, modules)
        _SHARED[key] = tuple((int(name.split(".")[1]), modules[name].init[0])
                             for name, style in styles.items() if style == "shared_input")
    return _SHARED[key]


def _gathered_sublayers(mine_all: list[ParamRec], projections: list[ParamRec], recompute: bool) -> tuple[int, int]:
    """(sub-layers that gather the sequence, those of them that gather it again in backward). Each gathers its
    input in forward and the gradient of its (re-sharded) output in backward: a dense sub-layer through its
    row-wise projection's reduce-scatter, an MoE through its own re-sharding (`sequence_gather_scatter`). Without
    checkpointing a sub-layer keeps the sequence shard of its gathered input and gathers it again in backward, if
    a trainable parameter reads that input (anything in the sub-layer but its row-wise projections and their
    adapters); compiled blocks, which keep the gathered input, send as many gathers (measured with aot_eager,
    torch 2.13)."""
    subs = {p.seq_sub for p in mine_all if p.seq_sub is not None and p.block is not None}
    rows: dict[str, set[str]] = {}
    for p in projections:
        if p.tp_dim == 1:
            rows.setdefault(p.seq_sub, set()).add(p.name.rsplit(".", 1)[0])
    # the sub-layers a trainable parameter outside their row-wise projections reads (one pass over the parameters)
    read = {q.seq_sub for q in mine_all if q.trainable and q.seq_sub is not None
            and not any(q.name.startswith(r + ".") for r in rows.get(q.seq_sub, ()))}
    return len(subs), 0 if recompute else len(subs & read)


def _expert_parallel(mine: list[ParamRec], args, cfg, layout: Layout, n_micro: int, micro: int,
                     add: AddComm) -> None:
    """Each token's top_k copies go to their experts and back, forward and backward (what one rank receives
    depends on the routing: this is the balanced count); first the per-expert counts (int64)."""
    t = cfg.training
    e = 2 if bf16_compute(cfg) else F32
    tokens = micro * t.seq_len // layout.cp
    moe_layers = len({p.block for p in mine if p.expert})
    # activation checkpointing runs the forward's two again in backward (and the counts' exchange)
    passes = 6 if cfg.distributed.ac_mode else 4
    counts = args.n_experts * 8 * (2 if cfg.distributed.ac_mode else 1)
    add("ep", "all_to_all", n_micro * moe_layers * (passes * tokens * args.top_k * args.dim * e + counts))


def _context_parallel(mine: list[ParamRec], args, cfg, layout: Layout, n_micro: int, micro: int,
                      add: AddComm) -> None:
    """Per attention layer and micro batch: all-gather of the local K/V in forward, again in backward, and a
    reduce-scatter of the K/V gradients (distributed/context_parallel.py); checkpointing adds the forward's."""
    t = cfg.training
    e = 2 if bf16_compute(cfg) else F32
    layers = len({p.block for p in mine if p.block is not None})
    kv = 2 * micro * (args.n_kv_heads // layout.tp) * t.seq_len * args.hd * e
    add("cp", "all_gather", n_micro * layers * kv * (3 if cfg.distributed.ac_mode else 2))
    add("cp", "reduce_scatter", n_micro * layers * kv)
