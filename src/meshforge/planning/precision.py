"""The dtypes a run computes, keeps and moves in, read from the config the way the runtime decides them (without
torch): every term of the plan (state, activations, communication) asks here."""

from __future__ import annotations

from meshforge.planning.params import memo

F32 = 4


def on_cuda(cfg) -> bool:
    return cfg.training.device != "cpu"


def bf16_params(cfg) -> bool:
    """training.precision=bf16_params: bf16 parameters with fp32 masters in the optimizer (unsharded), or fp32
    shards gathered in bf16 (a strategy whose spec keeps fp32 shards, over dp*cp > 1); bf16 compute on every
    device."""
    return cfg.training.precision == "bf16_params"


def compiled(cfg) -> bool:
    """training.compile on the run's device (distributed/compile.py's rule, without torch)."""
    return cfg.training.compile is True or (cfg.training.compile == "auto" and on_cuda(cfg))


def bf16_compute(cfg) -> bool:
    """Activations (and the tensors TP/CP/PP move) in bf16: autocast on CUDA, or bf16 parameters anywhere."""
    return bf16_params(cfg) or (cfg.training.precision == "bf16" and on_cuda(cfg))


def gather_bytes(cfg) -> int:
    """Element size of sharded parameters gathered for compute: the sharding strategies gather bf16 on CUDA, and
    under bf16_params on CPU too."""
    return 2 if (on_cuda(cfg) or bf16_params(cfg)) else F32


def residual_bytes(cfg, layout) -> int:
    """Element size of the hidden states a block hands on: the dtype its parameters are computed in (bf16 when a
    sharding strategy gathers bf16 or keeps bf16 compute buffers, and under bf16_params), fp32 when autocast
    runs over fp32 parameters (the residual additions stay fp32)."""
    if bf16_params(cfg):
        return 2
    spec = cfg.distributed.spec
    sharded = getattr(spec, "flat_buffers", False) or (spec.shards_parameters and layout.size("dp_cp") > 1)
    return 2 if on_cuda(cfg) and sharded else F32


def fused_loss_conflict(cfg) -> str | None:
    """Why the fused loss cannot run here (None: it can): only a model whose forward cannot hand the loss its
    head's input (a transformers model returns logits) or whose logits are not the head's plain output (Gemma 3's
    final soft-cap). Every layout runs it: TP (vocabulary-parallel), PP (on the last stage), fsdp2 and
    megatron_fsdp in every mode (a strategy keeps the unit holding the head gathered until its backward:
    `Strategy.head_read_after_forward`). `training.fused_loss=auto` then takes the plain
    loss, and says so (`warnings`, the plan's notes); an explicit true is refused."""
    if cfg.model.hf_model:
        return "model.hf_model: the transformers model's forward returns logits"
    key = cfg.model.model_dump_json()  # asked for every candidate of a search: the model is resolved once
    if key not in _CONFLICTS:
        from meshforge.models import resolve_model_args

        try:
            cap = resolve_model_args(cfg.model).final_logit_softcap
        except (KeyError, ValueError):  # an invalid model: the rules say why
            cap = None
        _CONFLICTS[key] = None if cap is None else (f"model.final_logit_softcap={cap}: the chunked loss projects "
                                                    "the head's input without the soft-cap")
    return _CONFLICTS[key]


_CONFLICTS: dict[str, str | None] = {}


def fused_loss_on(cfg) -> bool:
    """`training.fused_loss`: auto fuses where the layout allows (see `fused_loss_conflict`)."""
    setting = cfg.training.fused_loss
    return fused_loss_conflict(cfg) is None if setting == "auto" else bool(setting)


def fused_loss_note(cfg) -> str | None:
    """The line a run's log and its plan carry when `training.fused_loss=auto` takes the plain loss."""
    why = fused_loss_conflict(cfg) if cfg.training.fused_loss == "auto" else None
    return (f"training.fused_loss=auto takes the plain loss ({why}): full fp32 [batch, seq, vocab] logits are "
            "kept for backward") if why else None


# torchao's `_auto_filter_for_recipe` (training.fp8.filter=auto), on the weight's (out N, in K): which linears it
# converts (tests/unit/test_time_model.py checks these against torchao's own filter)
FP8_AUTO = {
    "tensorwise": lambda n, k: not (k <= 4096 and n <= 1024),
    "rowwise": lambda n, k: not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)),
}


def float8_weight(p, cfg) -> bool:
    """training.fp8: is `p` (a `ParamRec`) the weight of a linear torchao converts (distributed/float8.py)? The
    blocks' linears whose dimensions divide by 16, under `filter: auto` torchao's size filter on the whole
    weight; never the head, the embedding, routed experts or LoRA factors."""
    f = cfg.training.fp8
    if not f.enabled or p.block is None or p.expert or p.adapter or len(p.shape) != 2:
        return False
    n, k = p.shape
    return not (n % 16 or k % 16) and (f.filter == "all" or FP8_AUTO[f.recipe](n, k))


def float8_weights(params: list, cfg) -> frozenset[str]:
    """Names of the weights among `params` whose linears torchao converts (`float8_weight`), less LoRA-adapted
    linears' (distributed/float8.py converts plain linears only). Memoised per list."""
    def compute():
        adapted = {p.name.rsplit(".lora_", 1)[0] for p in params if p.adapter}
        return frozenset(p.name for p in params if float8_weight(p, cfg) and p.name.rsplit(".", 1)[0] not in adapted)

    f = cfg.training.fp8
    return memo("float8", params, (f.enabled, f.recipe, f.filter), compute) if f.enabled else frozenset()


def float8_gather(cfg) -> bool:
    """training.fp8 with tensorwise scales: a strategy that gathers float8 weights itself (its runtime's
    `float8_all_gather`) casts each converted weight's shard before the all-gather, 1 byte an element, and
    all-reduces the shard's fp32 amax over the gathering ranks first (`FLOAT8_AMAX` bytes per weight and gather:
    torchao's `fsdp_pre_all_gather` without precomputed scales, measured with the scale trace)."""
    return cfg.training.fp8.enabled and cfg.training.fp8.recipe == "tensorwise"


FLOAT8_AMAX = F32  # a float8-gathered weight's amax, all-reduced before each all-gather
# a scale's amax over tensor-parallel shards: DTensor reduces the Partial amax once torchao has cast it to float64
FLOAT8_TP_AMAX = 8
