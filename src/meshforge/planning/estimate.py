"""`meshforge plan`: memory per rank, communication, compute and step time of a config, without processes.

State (params, grads, optimizer) is computed per parameter from the model's description
(`models.plan_modules`: torch-free for the built-in models, LoRA included; the meta-device model for hf_model; one block
stands in for every block), its tensor-parallel plan, its pipeline split and
the strategy's storage rules, so it equals what the bench counts (`bench/measure.py`):
  fsdp2        each parameter's local (TP) tensor sharded on dim 0 over dp_shard*cp, padded to a multiple of
               it (params and grads hold the padded shard; AdamW's moments the unpadded torch.chunk piece);
               experts under EP: dim 0 over ep, dim 1 over ep_shard. HSDP replicates over dp_replicate.
  ddp          full replicas; the reducer's buckets hold a second copy of the gradients.
  megatron_fsdp one flat buffer per unit (each block, and everything else) padded to a multiple of dp*cp;
               no_shard/optim/optim_grads/optim_grads_params keep full or 1/N params, grads and moments.
  AdamW        exp_avg + exp_avg_sq (fp32) per optimizer tensor and a 4-byte `step`.
On CUDA, fsdp2 and megatron_fsdp compute in bf16 (megatron_fsdp keeps a bf16 compute buffer beside fp32 main).

LoRA (`peft:`): frozen parameters hold their parameter bytes only; adapters hold gradients and AdamW state too
(megatron_fsdp: the frozen parameters of each unit form a flat buffer of their own, values only; per-expert
adapters are stacked by expert and shard with EP like the experts).
training.precision=bf16_params: unsharded (world size 1), bf16 parameters, an fp32 main gradient (micro-batches
accumulate in fp32) and an fp32 master beside the moments in the optimizer (12 bytes + a step per tensor); fsdp2
over dp*cp > 1 keeps fp32 shards (the masters) and gathers them in bf16.

Activations per micro batch are the tensors autograd saves (see `activation_bytes`); a pipeline rank keeps as
many alive as the replay of its schedule's forward/backward order says (`_alive_peak`). Communication per step
per axis and collective kind follows the strategies' schedules (see `comm_per_step`). Compute is the model
contract's FLOPs per token at an assumed compute efficiency (`mfu`), plus recomputation and the pipeline bubble;
tensor/context/expert/pipeline traffic is on the critical path (meshforge's eager TP collectives do not overlap
compute), data-parallel traffic adds only what compute does not hide.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from meshforge.config.rules import PEFT_STRATEGIES, fused_loss_on
from meshforge.planning.hardware import Device
from meshforge.planning.layout import Layout, MeshAxis
from meshforge.planning.theory import textbook_bubble

F32 = 4
STEP_BYTES = 4  # AdamW's per-tensor `step` (a float32 scalar)


@dataclass(frozen=True)
class ParamRec:
    name: str
    shape: tuple[int, ...]
    block: int | None  # block index, None for the rest of the model
    tp_dim: int | None  # dimension split over tp, None when whole
    expert: bool  # stacked routed-expert weights (dim 0 = expert)
    place: str  # "block", "first" (first pipeline stage), "last" or "other"
    trainable: bool = True  # False: frozen (LoRA's base weights): no gradient, no optimizer state
    # replicated over tp while its gradient arrives Partial: the norms under sequence parallelism (their input is
    # sequence-sharded) and the LoRA factor kept whole beside a split base layer
    partial_grad: bool = False
    adapter: bool = False  # a LoRA factor (`models.lora.is_adapter_param`), decided once: the search asks often


def model_params(cfg) -> tuple[list[ParamRec], object]:
    """Every parameter of the configured built-in model (tied weights once), from its meta description."""
    from meshforge.models import plan_modules, resolve_model_args
    from meshforge.models.shapes import ADAPTER_PARTS, is_adapter_param
    from meshforge.models.shapes import model_contract
    from meshforge.planning.tp_plan import resolve_plan, sharded_dim

    args = resolve_model_args(cfg.model)
    one, modules = plan_modules(cfg.model)  # torch-free for the built-in models (models/shapes.py)
    if cfg.peft is not None:
        one, modules = _with_lora(one, modules, cfg.peft)
    contract = model_contract(one)
    layout = contract.pipeline_layout()
    container = layout.split_points[0].rpartition(".")[0] if layout else None
    d = cfg.distributed
    styles = {}
    if d.tp_size > 1:
        styles, _, _ = resolve_plan(one, d.sequence_parallel, d.tp_plan, modules)
    # the stacked expert weights and their per-expert LoRA factors (dim 0 = expert: they shard with EP)
    expert_ids = {id(p) for layer in contract.moe_layers() for p in layer.experts.parameters()}
    out, seen = [], set()
    for mname, mod in modules.items():
        block = None
        if container is not None and mname.startswith(container + "."):
            block = int(mname[len(container) + 1:].split(".")[0])
        for pname, p in mod.named_parameters(recurse=False):
            key = (id(p), block)
            if key in seen:
                continue
            seen.add(key)
            place = "block" if block is not None else "other"
            if layout is not None and block is None:
                top = mname.split(".")[0]
                place = "first" if top in layout.first_stage else "last" if top in layout.last_stage else "other"
            style = styles.get(mname)
            tp_dim = sharded_dim(mod, style) if style else None
            partial = style == "sequence_parallel"
            parent, _, part = mname.rpartition(".")
            if part in ADAPTER_PARTS and styles.get(parent):
                # LoRA factors follow their base layer's style (distributed/tensor_parallel.py): under colwise B is
                # split by rows and A whole; under rowwise A is split by columns and B whole
                tp_dim = {("colwise", "lora_B"): 0, ("rowwise", "lora_A"): 1}.get((styles[parent], part))
                partial = tp_dim is None
            full = f"{mname}.{pname}" if mname else pname
            out.append(ParamRec(full, tuple(p.shape), block, tp_dim, id(p) in expert_ids, place, p.requires_grad,
                                partial, is_adapter_param(full)))
    return out, args


def _with_lora(one, modules: dict, peft):
    """The one-block meta model with LoRA applied (adapters on the targeted linears, the freeze policy) and
    the whole model's {name: module} rebuilt from it, each block's modules standing in for every block's."""
    from meshforge.models.shapes import ModelShape
    from meshforge.models.shapes import apply_lora as apply_to_description

    if isinstance(one, ModelShape):
        apply_lora = apply_to_description  # the same adapters and freeze policy, without torch
    else:
        from meshforge.models.lora import apply_lora

    names: dict[int, list[str]] = {}  # each module object -> every name it stands under
    for n, m in modules.items():
        names.setdefault(id(m), []).append(n)
    before = dict(one.named_modules())
    apply_lora(one, peft)
    out = {}
    for name, mod in one.named_modules():
        old = before.get(name)
        if old is not None:
            for whole in names[id(old)]:
                out[whole] = mod
        else:  # a new adapter module (at any depth) under its nearest original ancestor: under each of that
            # ancestor's whole-model names (expert adapters sit two levels down: `experts.adapters.<role>`)
            parent, child = name, ""
            while parent and parent not in before:
                parent, _, last = parent.rpartition(".")
                child = f"{last}.{child}" if child else last
            for whole in names[id(before[parent])] if parent in before else []:
                out[f"{whole}.{child}" if whole else child] = mod
    return one, out


# ---------------------------------------------------------------------------------------------- state
def _chunk_rows(dim0: int, world: int, rank: int) -> int:
    size = -(-dim0 // world) if dim0 else 0
    start = min(rank * size, dim0)
    return min(start + size, dim0) - start


def _local_shape(p: ParamRec, layout: Layout) -> list[int]:
    s = list(p.shape)
    if p.tp_dim is not None:
        s[p.tp_dim] //= layout.tp
    if p.expert and layout.ep > 1:
        s[0] //= layout.ep
    return s


@dataclass
class Parts:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    host: int = 0  # CPU-offloaded state (fsdp2 offload_policy)
    buffers: int = 0  # gathered/communication buffers in flight at the peak (largest unit, buckets)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _stage_params(params: list[ParamRec], cfg, layout: Layout, pp_rank: int,
                  n_layers: int | None = None) -> list[list[ParamRec]]:
    """The parameters of each pipeline stage this pp rank holds (one list per stage; one list without PP)."""
    if layout.pp == 1:
        return [params]
    pplan = pipeline_plan_of(cfg, layout, n_layers)

    def compute():
        stages = []
        for s in pplan.rank_stages(pp_rank):
            blocks = set(pplan.stage_layers[s])
            stages.append([p for p in params if (p.block in blocks) or (p.place == "first" and s == 0)
                           or (p.place == "last" and s == pplan.num_stages - 1) or p.place == "other"])
        return stages

    return _memo("stages", params, (pplan, pp_rank), compute)


_STAGE_CACHE: dict = {}


def _memo(kind: str, obj, key: tuple, compute):
    """`compute()` memoised per (kind, the list `obj`, key): the search plans hundreds of candidates over the
    same parameter lists. The entry holds `obj`, so its id is not reused while cached."""
    hit = _STAGE_CACHE.get((kind, id(obj), key))
    if hit is not None and hit[0] is obj:
        return hit[1]
    if len(_STAGE_CACHE) > 8192:
        _STAGE_CACHE.clear()
    value = compute()
    _STAGE_CACHE[(kind, id(obj), key)] = (obj, value)
    return value


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


def _on_cuda(cfg) -> bool:
    return cfg.training.device != "cpu"


def _bf16_params(cfg) -> bool:
    """training.precision=bf16_params: bf16 parameters with fp32 masters in the optimizer (unsharded), or fp32
    shards gathered in bf16 (fsdp2 over dp*cp > 1); bf16 compute on every device."""
    return cfg.training.precision == "bf16_params"


def _compiled(cfg) -> bool:
    """training.compile on the run's device (distributed/compile.py's rule, without torch)."""
    return cfg.training.compile is True or (cfg.training.compile == "auto" and _on_cuda(cfg))


def _bf16_compute(cfg) -> bool:
    """Activations (and the tensors TP/CP/PP move) in bf16: autocast on CUDA, or bf16 parameters anywhere."""
    return _bf16_params(cfg) or (cfg.training.precision == "bf16" and _on_cuda(cfg))


def _gather_bytes(cfg) -> int:
    """Element size of sharded parameters gathered for compute: fsdp2 and megatron_fsdp gather bf16 on CUDA,
    fsdp2 also on CPU under bf16_params."""
    return 2 if (_on_cuda(cfg) or _bf16_params(cfg)) else F32


def _refuse_uncounted(params: list[ParamRec], cfg, layout: Layout) -> None:
    """Frozen parameters are counted for the strategies LoRA runs on (ddp, fsdp2, megatron_fsdp, with
    TP/SP/CP/PP/EP); another strategy is one line, never a silently wrong plan."""
    from meshforge.errors import ConfigError

    if all(p.trainable for p in params):
        return
    if cfg.distributed.strategy not in PEFT_STRATEGIES:
        raise ConfigError(f"meshforge plan does not count frozen (LoRA) parameters under distributed.strategy="
                          f"{cfg.distributed.strategy}: plan with strategy ddp, fsdp2 or megatron_fsdp")


def rank_state(params: list[ParamRec], cfg, layout: Layout, rank: int) -> Parts:
    """Bytes of parameters, gradients and optimizer state global rank `rank` holds after a step."""
    _refuse_uncounted(params, cfg, layout)
    c = layout.coords(rank)
    d = cfg.distributed
    strategy = d.strategy
    out = Parts()
    for stage in _stage_params(params, cfg, layout, c[MeshAxis.PP]):
        if strategy == "megatron_fsdp":
            _megatron(stage, cfg, layout, c, out)
        elif strategy == "fsdp2":
            _fsdp2(stage, cfg, layout, c, out)
        else:  # ddp and data-parallel plugins that keep full replicas
            _replicas(stage, layout, out, buckets=strategy == "ddp" and layout.dp * layout.cp > 1,
                      bf16=_bf16_params(cfg))
    return out


def _replicas(stage, layout, out: Parts, buckets: bool, bf16: bool = False) -> None:
    """Full replicas; gradients, the reducer's buckets (counted as gradients) and optimizer state only for the
    trainable parameters. `bf16` (bf16_params, unsharded): bf16 parameters, fp32 main gradients, and the
    optimizer's fp32 master beside the moments (`distributed/master_weights.py`)."""
    train = [p for p in stage if p.trainable]
    n = sum(math.prod(_local_shape(p, layout)) for p in stage)
    n_train = sum(math.prod(_local_shape(p, layout)) for p in train)
    e = 2 if bf16 else F32
    out.params += n * e
    out.grads += n_train * F32 * (2 if buckets else 1)
    out.optimizer += (3 if bf16 else 2) * n_train * F32 + STEP_BYTES * len(train)


def _fsdp2(stage, cfg, layout, c, out: Parts) -> None:
    active = layout.world_size > 1 and layout.size("dp_cp") > 1
    dense_n, dense_r = layout.dp_shard * layout.cp, c[MeshAxis.DP_SHARD_CP]
    ep_shard_n, ep_shard_r = layout.size(MeshAxis.EP_SHARD), c[MeshAxis.EP_SHARD]
    offload = bool(cfg.distributed.options.offload_policy)
    if not active and _bf16_params(cfg):  # unsharded bf16 parameters, fp32 masters in the optimizer
        _replicas(stage, layout, out, buckets=False, bf16=True)
        return
    for p, k in _alike(stage):  # every block has the same parameters: each kind once, times its count
        s = _local_shape(p, layout)
        full_grad = None
        if not active:
            stored = opt = math.prod(s)
            if p.tp_dim is not None and p.place == "first":
                # without FSDP the vocabulary-parallel embedding's gradient arrives Replicate: each tp rank
                # holds the whole (vocab x dim) gradient (measured with torch 2.13)
                full_grad = math.prod(p.shape)
        else:
            dim, n, r = (1, ep_shard_n, ep_shard_r) if p.expert and layout.ep > 1 else (0, dense_n, dense_r)
            rest = math.prod(s) // s[dim] if s[dim] else 0
            stored = -(-s[dim] // n) * rest
            opt = _chunk_rows(s[dim], n, r) * rest
        if not p.trainable:  # frozen: the (sharded) parameter only
            out.host += k * stored * F32 if offload else 0
            out.params += 0 if offload else k * stored * F32
            continue
        if offload:
            out.host += k * (2 * stored * F32 + 2 * opt * F32 + STEP_BYTES)
            continue
        out.params += k * stored * F32
        out.grads += k * (full_grad or stored) * F32
        out.optimizer += k * (2 * opt * F32 + STEP_BYTES)
    out.buffers = max(out.buffers, _largest_block(stage, layout) * _gather_bytes(cfg))


def _alike(stage: list[ParamRec]) -> list[tuple[ParamRec, int]]:
    """[(a parameter, how many of the stage's parameters are stored like it)]: those equal in shape, split,
    expert-ness, trainability and being the first stage's (memoised per stage list)."""
    def compute():
        kinds: dict = {}
        for p in stage:
            k = (p.shape, p.tp_dim, p.expert, p.trainable, p.place == "first")
            rep, n = kinds.get(k, (p, 0))
            kinds[k] = (rep, n + 1)
        return list(kinds.values())

    return _memo("alike", stage, (), compute)


def _fsdp_units(group: list[ParamRec], layout: Layout, dim: int, n: int) -> tuple[dict, dict]:
    """({unit: padded elements}, {unit: padded trainable elements}) of FSDP's units (each block, the rest)
    sharded on `dim` over `n` ranks; memoised per parameter list (the search asks again for every candidate)."""
    def compute():
        units: dict = {}
        grads: dict = {}  # the trainable part of each unit: what its reduce-scatter carries
        for p in group:
            s = _local_shape(p, layout)
            rest = math.prod(s) // s[dim] if s[dim] else 0
            padded = -(-s[dim] // n) * n * rest
            units[p.block] = units.get(p.block, 0) + padded
            grads[p.block] = grads.get(p.block, 0) + (padded if p.trainable else 0)
        return units, grads

    return _memo("units", group, (layout.tp, layout.ep, dim, n), compute)


def _largest_block(stage, layout) -> int:
    def compute():
        sizes: dict = {}
        for p in stage:
            sizes[p.block] = sizes.get(p.block, 0) + math.prod(_local_shape(p, layout))
        return max(sizes.values(), default=0)

    return _memo("largest", stage, (layout.tp, layout.ep), compute)


def _megatron_units(stage: list[ParamRec], layout: Layout) -> dict[tuple, list[int]]:
    """{(block, trainable): local element counts}: megatron_fsdp's flat buffers per unit, trainable and frozen
    parameters (LoRA) each in their own; memoised per parameter list (the search asks for every candidate)."""
    def compute():
        units: dict = {}
        for p in stage:
            units.setdefault((p.block, p.trainable), []).append(math.prod(_local_shape(p, layout)))
        return units
    return _memo("mfsdp", stage, (layout.tp, layout.ep), compute)


def _megatron(stage, cfg, layout, c, out: Parts) -> None:
    mode = cfg.distributed.options.sharding_strategy
    world, rank = (layout.size("dp_cp"), c[MeshAxis.DP_CP]) if layout.world_size > 1 else (1, 0)
    cuda = _on_cuda(cfg)
    compute_b = 2 if cuda else F32
    fp32_reduce = cfg.distributed.options.grad_reduce_in_fp32 is not False
    reduce_b = F32 if fp32_reduce else compute_b
    units = _megatron_units(stage, layout)
    gathered: dict = {}  # a block's units are gathered together
    for (block, trainable), numels in units.items():
        total = sum(numels)
        shard = -(-total // world) if total else 0
        padded = shard * world
        sharded = mode != "no_shard"
        lo, hi = (rank * shard, (rank + 1) * shard) if sharded else (0, padded)
        gathered[block] = gathered.get(block, 0) + padded * compute_b
        out.buffers = max(out.buffers, gathered[block])
        if not trainable:  # values only, in the compute dtype: no main copy, gradients or optimizer state
            out.params += (shard if mode == "optim_grads_params" else padded) * compute_b
            continue
        # params at rest: main (+ compute when not sharded, + a compute shard in another dtype)
        main = (shard if sharded else padded) * F32
        if mode == "no_shard":
            out.params += padded * compute_b + (0 if compute_b == F32 else main)
        elif mode in ("optim", "optim_grads"):
            out.params += padded * compute_b + main
        else:
            out.params += main + (0 if compute_b == F32 else shard * compute_b)
        if mode in ("optim_grads", "optim_grads_params"):
            out.grads += shard * reduce_b + (0 if reduce_b == F32 else shard * F32)
        else:
            out.grads += padded * reduce_b + (0 if reduce_b == F32 else (hi - lo) * F32)
        off = 0
        for n in numels:
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.optimizer += 2 * (b - a) * F32 + STEP_BYTES
            off += n


# ---------------------------------------------------------------------------------------- activations
def activation_bytes(args, cfg, layout: Layout, blocks: int, first: bool, last: bool,
                     micro_batch: int | None = None) -> dict[str, int]:
    """Bytes autograd saves for one micro batch on one rank: {"blocks", "embedding", "head", "total",
    "recompute"} ("recompute": the transient of one block recomputed in backward under checkpointing).

    Per token per block, with the Llama block's saved tensors (element size e, fp32 norms statistics):
      no checkpointing: 4*dim (block input and residual, kept by the norms; the two norms' outputs, kept by the
        projections) + 2 rsqrt + q, k, v and the attention output (2*(heads + kv_heads)*head_dim) + heads
        (softmax log-sum-exp) + 3*ffn (w1 and w3 outputs, kept by the fused SwiGLU; the product, kept by w2)
        [MoE: routed copies top_k*moe_ffn, router]
      full: the block input (dim) only; the block is recomputed in backward.
      selective: the block input + the matmul and attention outputs it caches (q, k, v, attention output and
        log-sum-exp, o-proj, ffn gate and up, down).
    TP divides heads and ffn by tp; sequence parallelism divides the norms' tensors too (without checkpointing
    the projections keep the sequence shard and gather it again in backward, distributed/tensor_parallel.py;
    recomputed blocks gather it in their recompute); CP divides the tokens.
    Head: the final norm (2*dim + 1), the fp32 log-softmax of the logits (vocab/tp per token; with the fused
    loss only its log-sum-exp, one fp32 per token: the logits are recomputed chunk by chunk), int64 labels.
    Measured against saved-tensor hooks on CPU: exact on one process, within 1% under TP/SP/CP.
    """
    d, t = cfg.distributed, cfg.training
    return dict(_activation_bytes(args, _bf16_compute(cfg), micro_batch or t.micro_batch_size,
                                  t.seq_len, layout.cp, layout.tp, d.sequence_parallel, d.ac_mode,
                                  fused_loss_on(cfg), blocks, first, last, _lora_profile(cfg, args),
                                  _compiled(cfg)))


LORA_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_profile(cfg, args) -> tuple | None:
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


@functools.lru_cache(maxsize=8192)
def _activation_bytes(args, bf16: bool, micro_batch: int, seq_len: int, cp: int, tp: int, sequence_parallel: bool,
                      mode: str | None, fused: bool, blocks: int, first: bool, last: bool,
                      lora: tuple | None = None, compiled: bool = False) -> dict[str, int]:
    e = 2 if bf16 else F32
    tokens = micro_batch * seq_len // cp
    sp = tp if sequence_parallel else 1
    hd, h, kv = args.hd, args.n_heads // tp, args.n_kv_heads // tp
    ffn = args.ffn_dim // tp
    if args.is_moe:
        ffn = (args.top_k * args.moe_ffn_dim + args.n_shared_experts * args.moe_ffn_dim) // tp
    dim_full = args.dim
    dim_sp = args.dim // sp
    attn = 2 * (h + kv) * hd  # q, k, v, attention output
    mm = 3 * ffn
    if mode is None:
        per_tok = (4 * dim_sp + attn + mm) * e + (2 + h) * F32
        if compiled and sp > 1:  # compiled blocks keep each sub-layer's gathered input whole (measured, CPU)
            per_tok += 2 * (dim_full - dim_sp) * e
    elif mode == "full":
        per_tok = dim_sp * e
    else:
        per_tok = (dim_sp + attn + 2 * dim_full + 2 * ffn) * e + h * F32
    full_block = (4 * dim_sp + attn + mm) * e + (2 + h) * F32
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


# ---------------------------------------------------------------------------------------------- comm
def comm_per_step(params: list[ParamRec], args, cfg, layout: Layout, rank: int = 0) -> dict[tuple[str, str], int]:
    """{(axis, kind): bytes} one rank hands to collectives per optimizer step (full-buffer side, as the bench
    counts: all-gather output, reduce-scatter input, all-reduce tensor, all-to-all input, p2p tensor)."""
    d, t = cfg.distributed, cfg.training
    c = layout.coords(rank)
    out: dict[tuple[str, str], int] = {}

    def add(axis, kind, n):
        if n:
            out[(axis, kind)] = out.get((axis, kind), 0) + int(n)

    dp_cp = layout.size("dp_cp")
    micro_per_rank = t.global_batch_size // layout.dp
    accum = 1 if layout.pp > 1 else micro_per_rank // t.micro_batch_size
    e_param = _gather_bytes(cfg)
    stages = _stage_params(params, cfg, layout, c[MeshAxis.PP], args.n_layers)
    shard_axis = "dp_shard_cp" if layout.cp > 1 else "dp_shard"
    for stage in stages:
        dense = stage if layout.ep == 1 else [p for p in stage if not p.expert]
        experts = [p for p in stage if p.expert and layout.ep > 1]
        if d.strategy == "fsdp2" and dp_cp > 1 and layout.world_size > 1:
            n, ne = layout.dp_shard * layout.cp, layout.size(MeshAxis.EP_SHARD)
            for group, nn_, dim in ((dense, n, 0), (experts, ne, 1)):
                if not group or nn_ == 1:
                    continue
                units, grads = _fsdp_units(group, layout, dim, nn_)
                blocks = sorted(k for k in units if k is not None)
                reshard = d.options.reshard_after_forward
                regather = [b for b in blocks if (b != blocks[-1] if reshard is None else reshard)]
                if reshard is None and layout.pp > 1:
                    regather = []
                total = sum(units.values())
                gathers = total + sum(units[b] for b in regather) + (units.get(None, 0) if reshard else 0)
                reps = accum if (layout.pp == 1) else 1
                ax = shard_axis if dim == 0 else "ep_shard"
                add(ax, "all_gather", gathers * reps * e_param)
                add(ax, "reduce_scatter", sum(grads.values()) * F32)
                if dim == 0 and layout.dp_replicate > 1:
                    add("dp_replicate", "all_reduce", sum(grads.values()) // nn_ * F32)
        elif d.strategy == "megatron_fsdp" and dp_cp > 1:
            mode = d.options.sharding_strategy
            units = {k: sum(v) for k, v in _megatron_units(stage, layout).items()}  # {(block, trainable): elements}
            pad = {k: -(-u // dp_cp) * dp_cp for k, u in units.items()}
            padded = sum(pad.values())
            train = sum(v for (_, tr), v in pad.items() if tr)  # only trainable units are reduced and re-gathered
            blocks = sorted({b for b, _ in units if b is not None})
            if mode in ("no_shard", "optim"):
                add("dp_cp", "all_reduce", train * F32)
            else:
                add("dp_cp", "reduce_scatter", train * F32)
            if mode in ("optim", "optim_grads"):
                add("dp_cp", "all_gather", train * e_param)
            if mode == "optim_grads_params":
                last = sum(v for (b, _), v in pad.items() if blocks and b == blocks[-1])
                root = sum(v for (b, _), v in pad.items() if b is None)
                add("dp_cp", "all_gather", (2 * padded - last - root) * accum * e_param)
        elif d.strategy != "fsdp2" and dp_cp > 1:
            add("dp", "all_reduce", sum(math.prod(_local_shape(p, layout)) for p in stage if p.trainable) * F32)
    # tensor parallelism, per micro batch (measured on torch's DTensor styles). Without sequence parallelism: an
    # all-reduce of the activations (tokens x dim) after each row-wise projection and the vocabulary-parallel
    # embedding (forward), of the input gradient of each column-wise projection and of the output head
    # (backward). With it, each sub-layer all-gathers its sequence-sharded input and reduce-scatters its output
    # (forward), the output's gradient is all-gathered (backward) and each column-wise projection all-reduces
    # its input gradient as without it; the embedding reduce-scatters (forward) and the head all-gathers
    # (forward), each with its mirror in backward; without checkpointing each sub-layer gathers its kept
    # sequence shard again in backward (distributed/tensor_parallel.py). Checkpointing (full or selective) runs
    # the block's forward collectives again, except the last reduction of each block: the recomputation stops at
    # the last tensor backward needs (non-reentrant checkpoint), and the block's output is not one. The
    # vocabulary-parallel loss reduces the max, sum of exponentials and target logit of every token (3 x tokens x
    # 4 bytes).
    if layout.tp > 1:
        e = 2 if _bf16_compute(cfg) else F32
        tokens = t.micro_batch_size * t.seq_len // layout.cp
        act = tokens * args.dim * e
        mine_all = [p for st in stages for p in st]
        mine = [p for p in mine_all if p.tp_dim is not None and not p.adapter]
        in_blocks = [p for p in mine if p.block is not None]
        rows = sum(1 for p in in_blocks if p.tp_dim == 1)  # row-wise projections: one per sub-layer
        cols = sum(1 for p in in_blocks if p.tp_dim == 0)
        n_blocks = len({p.block for p in in_blocks})
        first = any(p.place == "first" for p in mine)
        head = any(p.place == "last" for p in mine)
        # a frozen embedding (and frozen norms in the first block) needs no gradient of its output: backward
        # skips the embedding's mirror collective and the input gradients of the first sub-layer's column-wise
        # projections (those before the first block's first row-wise one)
        frozen_in = first and not any(p.trainable for p in mine_all if p.place == "first" or
                                      (p.block == 0 and len(p.shape) == 1))
        skip = 0
        if frozen_in:
            for p in (p for p in mine if p.block == 0):
                if p.tp_dim == 1:
                    break
                skip += 1
        n_micro = micro_per_rank // t.micro_batch_size
        recompute = d.ac_mode is not None
        loss = 3 * tokens * F32 if head else 0
        # replicated parameters with Partial gradients are all-reduced twice per step, by the gradient norm and
        # by the optimizer step (measured, torch 2.13, dp 1)
        partial = 2 * F32 * sum(math.prod(p.shape) for p in mine_all if p.partial_grad and p.trainable)
        if d.sequence_parallel:
            # without checkpointing a sub-layer (the parent of its row-wise projection) keeps the sequence shard
            # of its gathered input and gathers it again in backward, if a trainable parameter reads that input
            # (anything in the sub-layer but the row-wise projection and its adapters); compiled blocks, which
            # keep the gathered input, send as many gathers (measured with aot_eager, torch 2.13)
            subs = {p.name.rsplit(".", 2)[0]: p.name.rsplit(".", 1)[0] for p in in_blocks if p.tp_dim == 1}
            regather = 0 if recompute else sum(
                any(q.trainable and q.name.startswith(sub + ".") and not q.name.startswith(row + ".")
                    for q in mine_all) for sub, row in subs.items())
            add("tp", "all_gather",
                n_micro * (2 * rows + first + head - frozen_in + (rows if recompute else 0) + regather) * act)
            add("tp", "reduce_scatter", n_micro * (rows + first + head + (rows - n_blocks if recompute else 0)) * act)
            add("tp", "all_reduce", n_micro * ((cols - skip) * act + loss) + partial)
        else:
            redo = rows - n_blocks if recompute else 0
            add("tp", "all_reduce", n_micro * ((rows + cols - skip + first + head + redo) * act + loss) + partial)
    # scalars: the loss averaged over the data-parallel ranks and its label-token count; the gradient norm: one
    # 4-byte all-reduce per DTensor gradient and mesh dimension it is sharded over (megatron_fsdp: one for its
    # sharded optimizer), and the squares of the pipeline stages summed over pp
    if layout.world_size > 1 and dp_cp > 1:
        add("dp_cp", "all_reduce", F32)
        add("dp_cp", "all_reduce", 8)  # the global count of label tokens (int64) that normalises the loss
    fsdp_on = d.strategy == "fsdp2" and dp_cp > 1 and layout.world_size > 1
    n_ep = n_dp = n_tp = 0
    for p in (p for st in stages for p in st if p.trainable):
        if p.expert and layout.ep > 1:
            n_ep += 1
            continue
        n_dp += fsdp_on
        # (without FSDP the vocab-parallel embedding's grad is Replicate)
        n_tp += layout.tp > 1 and p.tp_dim is not None and (fsdp_on or p.place != "first")
    add("ep", "all_reduce", n_ep * F32 * (1 + (fsdp_on and layout.size(MeshAxis.EP_SHARD) > 1)))
    add("dp_cp", "all_reduce", n_dp * F32)
    add("tp", "all_reduce", n_tp * F32)
    if d.strategy == "megatron_fsdp" and dp_cp > 1 and d.options.sharding_strategy != "no_shard":
        add("dp_cp", "all_reduce", F32)
    if layout.pp > 1:
        pplan = pipeline_plan_of(cfg, layout, args.n_layers)
        e = 2 if _bf16_compute(cfg) else F32
        act = pplan.microbatch_size * t.seq_len // layout.cp * args.dim // (layout.tp if d.sequence_parallel else 1)
        add("pp", "send_recv", 2 * pplan.n_microbatches * act * e * len(pplan.rank_stages(c[MeshAxis.PP])))
        add("pp", "broadcast", F32)  # the last stage's loss to the other stages
        add("pp", "all_reduce", F32)  # the stages' squared gradient norms
    if layout.ep > 1 and args.is_moe:
        e = 2 if _bf16_compute(cfg) else F32
        n_micro = micro_per_rank // t.micro_batch_size
        tokens = t.micro_batch_size * t.seq_len // layout.cp
        moe_layers = len({p.block for st in stages for p in st if p.expert})
        # each token's top_k copies go to their experts and back, forward and backward (what one rank receives
        # depends on the routing: this is the balanced count); first the per-expert counts (int64)
        add("ep", "all_to_all", n_micro * moe_layers * (4 * tokens * args.top_k * args.dim * e + args.n_experts * 8))
    if layout.cp > 1:
        # per attention layer and micro batch: all-gather of the local K/V in forward, again in backward, and a
        # reduce-scatter of the K/V gradients (distributed/context_parallel.py); checkpointing adds the forward's
        e = 2 if _bf16_compute(cfg) else F32
        n_micro = micro_per_rank // t.micro_batch_size
        layers = len({p.block for st in stages for p in st if p.block is not None})
        kv = 2 * t.micro_batch_size * (args.n_kv_heads // layout.tp) * t.seq_len * args.hd * e
        add("cp", "all_gather", n_micro * layers * kv * (3 if d.ac_mode else 2))
        add("cp", "reduce_scatter", n_micro * layers * kv)
    return out


# ---------------------------------------------------------------------------------------------- plan
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


def bubble_fraction(schedule: str, p: int, m: int, v: int) -> float:
    """Idle fraction of a pipeline schedule: the textbook one (`theory.textbook_bubble`); the zero-bubble
    schedules fill most of it with the weight half of backward (counted as a third of it)."""
    frac = textbook_bubble(schedule, p, m, v)
    return frac / 3 if schedule in ("zero_bubble", "v_schedule") else frac


@functools.lru_cache(maxsize=4096)
def _alive_peak(schedule: str, p: int, r: int, m: int, weights: tuple[int, ...]) -> tuple[int, int]:
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
    peak = count = n = now = f = b = 0
    pending: list[int] = []
    order = ["F"] * warmup + ["F", "B"] * (total - warmup) + ["B"] * warmup
    for op in order:
        if op == "F":
            now += weights[f_stage(f)]
            f += 1
            n += 1
            if now > peak:
                peak, count = now, n
            continue
        pending.append(b_stage(warmup + b))
        if b >= lag:
            now -= weights[pending.pop(0)]
            n -= 1
        b += 1
    return peak, count


def _link_bytes_per_s(axis: str, layout: Layout, dev: Device, gpus_per_node: int) -> float:
    """Bandwidth of an axis: NVLink when its groups fit inside one node, the fabric otherwise."""
    span = {"tp": layout.tp, "cp": layout.cp * layout.tp, "dp_shard": layout.dp_shard * layout.cp * layout.tp,
            "dp_shard_cp": layout.dp_shard * layout.cp * layout.tp, "ep": layout.ep * layout.tp,
            "ep_shard": layout.world_size // layout.pp, "dp_cp": layout.world_size // layout.pp,
            "dp": layout.world_size // layout.pp, "dp_replicate": layout.world_size // layout.pp,
            "pp": layout.world_size}.get(axis, layout.world_size)
    return (dev.nvlink_gbps if span <= gpus_per_node else dev.fabric_gbps) * 1e9


def _comm_seconds(key: tuple[str, str], n: int, layout: Layout, dev: Device, gpus_per_node: int) -> float:
    """Time of `n` full-buffer bytes of one collective kind on a ring: each rank sends (size-1)/size of the buffer
    for an all-gather, reduce-scatter or all-to-all, twice that for an all-reduce (a reduce-scatter followed by
    an all-gather)."""
    axis, kind = key
    size = _axis_size(axis, layout)
    passes = 2 if kind == "all_reduce" else 1
    return passes * n * (size - 1) / max(size, 1) / _link_bytes_per_s(axis, layout, dev, gpus_per_node)


def _axis_size(axis: str, layout: Layout) -> int:
    if axis == "pp":
        return 2
    return layout.size(axis)


def _stage_signature(pplan, pp_rank: int) -> tuple:
    here = pplan.rank_stages(pp_rank)
    return (tuple(len(pplan.stage_layers[s]) for s in here), 0 in here, pplan.num_stages - 1 in here)


def representative_ranks(layout: Layout) -> list[int]:
    """Every rank for small worlds; else, per pp rank, the first and the last dp_shard_cp shard (the only ranks
    whose bytes differ: the first shards hold the most optimizer state, padding lands on the last)."""
    if layout.world_size <= 64:
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
    ranks = []
    pplan = pipeline_plan_of(cfg, layout, args.n_layers) if layout.pp > 1 else None
    key = (layout, d.strategy, d.options.model_dump_json(), t.device)
    if state_cache is None or key not in state_cache:
        # ranks whose pipeline stages hold the same number of blocks (and the same ends of the model) at the same
        # data-parallel coordinates hold the same bytes: each distinct one is computed once
        states, same = [], {}
        for r in representative_ranks(layout):
            c = layout.coords(r)
            sig = (c[MeshAxis.DP_SHARD_CP], c[MeshAxis.DP_CP], c[MeshAxis.EP_SHARD], c[MeshAxis.PP] if pplan is None
                   else _stage_signature(pplan, c[MeshAxis.PP]))
            if sig not in same:
                same[sig] = rank_state(params, cfg, layout, r)
            states.append((r, same[sig]))
        if state_cache is not None:
            state_cache[key] = states
    else:
        states = state_cache[key]

    @functools.cache
    def acts_of(blocks: int, first: bool, last: bool) -> dict:
        return activation_bytes(args, cfg, layout, blocks, first, last, pplan.microbatch_size if pplan else None)

    for r, parts in states:
        c = layout.coords(r)
        if pplan is not None:
            here = pplan.rank_stages(c[MeshAxis.PP])
            blocks = sum(len(pplan.stage_layers[s]) for s in here) // len(here)
            first, last = 0 in here, pplan.num_stages - 1 in here
            acts = dict(acts_of(blocks, first, last))
            weights = tuple(acts_of(len(pplan.stage_layers[s]), s == 0, s == pplan.num_stages - 1)["total"]
                            for s in here)
            alive, in_flight = _alive_peak(pplan.schedule, layout.pp, c[MeshAxis.PP], pplan.n_microbatches,
                                           weights)
        else:
            acts = dict(acts_of(args.n_layers, True, True))
            in_flight, alive = 1, acts["total"]
        peak = parts.total + parts.buffers + alive + acts["recompute"]
        ranks.append(RankPlan(r, parts, acts, in_flight, peak))
    comm = comm_per_step(params, args, cfg, layout)
    secs = {key: _comm_seconds(key, n, layout, device, gpus_per_node) for key, n in comm.items()}
    comm_s = sum(secs.values())
    model_fpt = _flops_per_token(args, t.seq_len)
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
    n_params = _n_params(params)
    return Plan(world_size, layout, d.strategy, d.options.sharding_strategy if d.strategy == "megatron_fsdp"
                else None, ranks, comm, comm_s, compute_s, bubble, step_s, tps, achieved, model_fpt, n_params,
                device, peak <= device.memory_bytes, _notes(cfg))


def _args_of(cfg):
    from meshforge.models import resolve_model_args

    return resolve_model_args(cfg.model)


def _notes(cfg) -> list[str]:
    """What the plan does not count exactly for this config, said with the plan."""
    out = []
    d = cfg.distributed
    if _compiled(cfg):
        out.append("training.compile: activations are counted as measured with torch.compile on CPU (eager's "
                   "tensors, and under sequence parallelism without checkpointing each sub-layer's gathered input "
                   "whole, where eager keeps the shard); inductor's partitioner on CUDA may keep less")
    if cfg.peft is not None and d.tp_size * d.cp_size > 1:
        out.append("LoRA: activations are exact on one process; under tensor/context parallelism they were "
                   "measured within 0.4% (TP2 + sequence parallelism +0.2%, CP2 +0.4%), not exact")
    if _bf16_params(cfg) and d.tp_size > 1:
        out.append("bf16_params: activations (bf16) are exact on one process and within 0.8% under context "
                   "parallelism (CP2); under tensor parallelism they are counted alike but not measured")
    if cfg.peft is not None and _lora_profile(cfg, _args_of(cfg)) is None:
        out.append("LoRA: activations are counted as for full training (this model's adapter roles are not the "
                   "Llama block's); parameters, gradients, optimizer state and communication are exact")
    return out


def _n_params(params: list[ParamRec]) -> int:
    return _memo("n", params, (), lambda: sum(math.prod(p.shape) for p in params))


@functools.lru_cache(maxsize=64)
def _flops_per_token(args, seq_len: int) -> float:
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
