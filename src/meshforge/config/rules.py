"""Every cross-field constraint, checked before any process group exists.

Each rule is one function `(cfg, world_size) -> list[str]`; a message names the
keys, their values and the fix. `check` runs all of them and returns every
violation at once. `warnings` returns the notes for options that are accepted
but do nothing in this configuration (silent no-op blocks are a top complaint
about the reference projects, so we always say so).

`world_size=None` means "the smallest world this config describes": an explicit
dp_size (or dp_replicate_size, or 1) times tp * pp * cp.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshforge.config.strategies import dp_size, either, strategy_specs
from meshforge.models import FAMILIES, packing_problem, resolve_model_args
from meshforge.planning.layout import Layout
from meshforge.planning.precision import fused_loss_conflict, fused_loss_note
from meshforge.planning.pipeline_plan import pipeline_problems

if TYPE_CHECKING:
    from meshforge.config.schema import Config

Rule = Callable[["Config", int], list[str]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def default_world_size(cfg: Config) -> int:
    d = cfg.distributed
    dp = d.dp_size or d.dp_replicate_size or 1
    return dp * d.tp_size * d.pp_size * d.cp_size


def layout_of(cfg: Config, world_size: int) -> Layout:
    d = cfg.distributed
    return Layout.from_sizes(world_size, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size,
                             dp=d.dp_size, dp_replicate=d.dp_replicate_size)


def _model_args(cfg: Config):
    """The resolved model, or None when it is invalid (reported once, by `model_fits_data`)."""
    try:
        return resolve_model_args(cfg.model)
    except (KeyError, ValueError):
        return None


# 1 ----------------------------------------------------------------------------
@rule
def dp_size_inferred(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    denom = d.tp_size * d.pp_size * d.cp_size
    if world_size % denom:
        return [f"distributed.tp_size*pp_size*cp_size = {d.tp_size}*{d.pp_size}*{d.cp_size} = {denom} does not "
                f"divide the world size {world_size}: choose sizes whose product divides {world_size}"]
    if d.dp_size is not None and d.dp_size != world_size // denom:
        return [f"distributed.dp_size={d.dp_size} disagrees with world_size/(tp_size*pp_size*cp_size) = "
                f"{world_size}/{denom} = {world_size // denom}: remove dp_size (it is inferred) or fix the sizes"]
    return []


# 2 ----------------------------------------------------------------------------
_AXIS_KEYS = {"tp": "tp_size", "pp": "pp_size", "cp": "cp_size", "ep": "ep_size", "sp": "sequence_parallel",
              "hsdp": "dp_replicate_size"}


def _axes_used(cfg: Config) -> list[str]:
    d = cfg.distributed
    used = [a for a in ("tp", "pp", "cp", "ep") if getattr(d, f"{a}_size") > 1]
    if d.sequence_parallel:
        used.append("sp")
    if (d.dp_replicate_size or 1) > 1:
        used.append("hsdp")
    return used


@rule
def strategy_composes(cfg: Config, world_size: int) -> list[str]:
    """Each parallelism in use must be one the strategy composes with (its spec's `composes_with`)."""
    d = cfg.distributed
    spec, specs = d.spec, strategy_specs()
    out = []
    for axis in _axes_used(cfg):
        if axis in spec.composes_with:
            continue
        key = _AXIS_KEYS[axis]
        value = str(getattr(d, key)).lower()
        able = [s.name for s in specs.values() if axis in s.composes_with]
        fix = f"use strategy {' or '.join(able)}" if able else f"set {key} back to its default"
        out.append(f"distributed.{key}={value} is not supported by strategy {spec.name} ({spec.description}): {fix}")
    return out


@rule
def strategy_own_rules(cfg: Config, world_size: int) -> list[str]:
    out = []
    for fn in cfg.distributed.spec.rules:
        out += fn(cfg, world_size)
    return out


# 3 ----------------------------------------------------------------------------
@rule
def expert_parallel(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if d.ep_size == 1:
        return []
    out = []
    dp = dp_size(cfg, world_size)
    if dp is not None and (dp * d.cp_size) % d.ep_size:
        out.append(f"distributed.ep_size={d.ep_size} must divide dp_size*cp_size = {dp}*{d.cp_size} = "
                   f"{dp * d.cp_size}: choose an ep_size that divides it")
    args = _model_args(cfg)
    if args is None or args.hf_model:  # (a transformers model's experts: hf_model_experts)
        return out
    if not args.is_moe:
        out.append(f"distributed.ep_size={d.ep_size} needs a mixture-of-experts model, but model.preset="
                   f"{cfg.model.preset!r} is dense: set ep_size 1 or use an MoE preset (e.g. tiny_moe)")
    else:
        n = args.n_experts
        if n % d.ep_size:
            out.append(f"distributed.ep_size={d.ep_size} must divide model.n_experts={n} (each ep rank holds "
                       f"n_experts/ep_size experts): choose an ep_size dividing {n}")
    return out


# 6 ----------------------------------------------------------------------------
@rule
def sequence_parallel_needs_tp(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if d.sequence_parallel and d.tp_size == 1:
        return ["distributed.sequence_parallel=true requires tp_size > 1 (it shards along the TP group): "
                "set tp_size or sequence_parallel false"]
    return []


# 9 ----------------------------------------------------------------------------
@rule
def overwrite_starts_fresh(cfg: Config, world_size: int) -> list[str]:
    if cfg.run.overwrite and cfg.checkpoint.resume is not None:
        return [f"run.overwrite=true starts a fresh run but checkpoint.resume={cfg.checkpoint.resume}: set "
                "checkpoint.resume=none (or drop run.overwrite to resume)"]
    return []


@rule
def restarts_resume(cfg: Config, world_size: int) -> list[str]:
    if cfg.resilience.max_restarts and cfg.checkpoint.resume != "auto":
        return [f"resilience.max_restarts={cfg.resilience.max_restarts} restarts from the last committed checkpoint, "
                f"but checkpoint.resume={cfg.checkpoint.resume}: set checkpoint.resume=auto (or max_restarts 0)"]
    return []


@rule
def checkpoint_format(cfg: Config, world_size: int) -> list[str]:
    fmt, spec = cfg.checkpoint.ckpt_format, cfg.distributed.spec
    if fmt is not None and fmt not in spec.ckpt_formats:
        return [f"checkpoint.ckpt_format={fmt} is not supported by strategy {spec.name}: set checkpoint.ckpt_format="
                f"{spec.ckpt_formats[0]} (or leave it unset)"]
    return []


# 11 ---------------------------------------------------------------------------
@rule
def cuda_device_max_connections(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and d.spec.shards_parameters \
            and world_size > 1 and cfg.training.device != "cpu" and _cuda_available():
        return [f"CUDA_DEVICE_MAX_CONNECTIONS=1 serialises the side-stream collectives strategy {d.strategy} "
                "overlaps with compute: unset it (meshforge sets it for TP/CP without FSDP itself)"]
    return []


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


# 12 ---------------------------------------------------------------------------
@rule
def batch_and_sequence(cfg: Config, world_size: int) -> list[str]:
    d, t = cfg.distributed, cfg.training
    out = []
    dp = dp_size(cfg, world_size)
    if dp is not None and t.global_batch_size % (t.micro_batch_size * dp):
        out.append(f"training.global_batch_size={t.global_batch_size} must be divisible by micro_batch_size*"
                   f"dp_size = {t.micro_batch_size}*{dp} = {t.micro_batch_size * dp}: pick a multiple of "
                   f"{t.micro_batch_size * dp}")
    if d.cp_size > 1 and t.seq_len % (2 * d.cp_size):
        out.append(f"training.seq_len={t.seq_len} must be divisible by 2*cp_size = {2 * d.cp_size} "
                   "(causal load balancing gives each cp rank one early and one late chunk)")
    if d.sequence_parallel and t.seq_len % d.tp_size:
        out.append(f"training.seq_len={t.seq_len} must be divisible by tp_size={d.tp_size} with sequence_parallel")
    if d.sequence_parallel and d.cp_size > 1 and (t.seq_len // d.cp_size) % d.tp_size:
        out.append(f"training.seq_len/cp_size = {t.seq_len // d.cp_size} must be divisible by tp_size={d.tp_size} "
                   "with sequence_parallel and cp")
    return out  # the pipeline's microbatch arithmetic is checked by `pipeline_split`


@rule
def model_fits_data(cfg: Config, world_size: int) -> list[str]:
    try:
        args = resolve_model_args(cfg.model)
    except (KeyError, ValueError) as err:
        return [str(err.args[0]) if err.args else str(err)]
    out = []
    if cfg.training.seq_len > args.max_seq_len:
        out.append(f"training.seq_len={cfg.training.seq_len} exceeds model.max_seq_len={args.max_seq_len}: "
                   "shorten seq_len or raise model.max_seq_len")
    exact_windows = not args.hf_model and FAMILIES[args.family].exact_windows  # masked per layer: any length
    if args.sliding_window is not None and cfg.training.seq_len > args.sliding_window and not exact_windows:
        out.append(f"training.seq_len={cfg.training.seq_len} exceeds model.sliding_window={args.sliding_window}: "
                   "sliding-window attention is exact only up to the window; shorten seq_len")
    if any(s.source == "text" for s in cfg.data.sources()) and args.vocab_size < 256:
        out.append(f"model.vocab_size={args.vocab_size} is smaller than the 256 byte tokens of data.source=text")
    d = cfg.distributed
    if d.tp_size > 1:
        for name, val in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
            if val % d.tp_size:
                out.append(f"model.{name}={val} is not divisible by distributed.tp_size={d.tp_size}: "
                           "tensor parallelism splits attention heads evenly")
    return out


@rule
def pipeline_split(cfg: Config, world_size: int) -> list[str]:
    """pp_size > 1: the stage split, schedule and microbatch count (planning/pipeline_plan.py), and what PP
    does not compose with yet."""
    d, t = cfg.distributed, cfg.training
    args = _model_args(cfg)
    if d.pp_size == 1 or args is None:
        return []
    out = []
    dp = dp_size(cfg, world_size)
    if dp is not None and t.global_batch_size % dp == 0:
        out += pipeline_problems(args.n_layers, d.pp_size, d.pipeline_or_default, t.global_batch_size // dp)
    return out


@rule
def tensor_parallel_plan(cfg: Config, world_size: int) -> list[str]:
    """The model's TP plan plus distributed.tp_plan must name real modules whose shapes divide by tp_size
    (checked on the model's description, torch-free for the built-in models; see planning/tp_plan.py)."""
    d = cfg.distributed
    if d.tp_plan and d.tp_size == 1:
        return ["distributed.tp_plan is set but distributed.tp_size=1, so it would do nothing: set tp_size > 1 "
                "or remove tp_plan"]
    if d.tp_size == 1 or _model_args(cfg) is None or (cfg.model.hf_model and d.sequence_parallel):
        return []  # (hf_model with sequence_parallel: refused by hf_model_keys)
    # imported here: a config without TP never needs the plan check (hf_model's builds a meta-device model)
    from meshforge.planning.tp_plan import config_plan_problems

    try:
        return config_plan_problems(cfg.model, d.tp_size, d.sequence_parallel, d.tp_plan)
    except ValueError as err:  # a plan the model cannot declare (model.hf_model: a style meshforge cannot map)
        return [str(err)]


@rule
def schedule_and_profiling_steps(cfg: Config, world_size: int) -> list[str]:
    """wsd's phases and the profiled steps must fit inside training.max_steps; a memory snapshot needs CUDA."""
    s, p, t = cfg.scheduler, cfg.profiling, cfg.training
    out = []
    if s.name == "wsd" and s.warmup_steps + s.decay_steps > t.max_steps:
        out.append(f"scheduler.warmup_steps + decay_steps = {s.warmup_steps}+{s.decay_steps} exceeds "
                   f"training.max_steps={t.max_steps}: shorten the decay or the warmup")
    if p.enabled and p.steps[1] > t.max_steps:
        out.append(f"profiling.steps={list(p.steps)} ends after training.max_steps={t.max_steps}: profile steps "
                   f"inside the run")
    if p.enabled and p.memory_snapshot and t.device == "cpu":
        out.append("profiling.memory_snapshot=true needs CUDA (training.device=cpu): set it false; the trace "
                   "works on CPU")
    return out


@rule
def peft_composes(cfg: Config, world_size: int) -> list[str]:
    """LoRA runs on the strategies whose spec keeps frozen parameters without gradient or optimizer state (with
    the parallelisms each composes with, and activation checkpointing) on a model that declares an adapter
    layout; what is not built yet is refused here, never run half-right."""
    p, d = cfg.peft, cfg.distributed
    if p is None:
        return []
    out = []
    if not d.spec.frozen_params:
        able = [s.name for s in strategy_specs().values() if s.frozen_params]
        out.append(f"peft (LoRA) with distributed.strategy={d.strategy} is not supported yet (frozen base weights "
                   f"would still take gradient and optimizer memory): use strategy {', '.join(able)}")
    if cfg.checkpoint.save_consolidated:
        out.append("checkpoint.save_consolidated with peft: a LoRA checkpoint holds the adapters only; leave it off "
                   "and run `meshforge checkpoint export --adapter` (PEFT format) or `--merge` (merged HF weights)")
    if _model_args(cfg) is not None:
        from meshforge.models import plan_modules  # torch-free for the built-in models
        from meshforge.models.shapes import check_targets

        try:
            check_targets(plan_modules(cfg.model)[0], p)
        except ValueError as err:
            out.append(str(err))
    return out


@rule
def fused_loss_layout(cfg: Config, world_size: int) -> list[str]:
    why = fused_loss_conflict(cfg) if cfg.training.fused_loss is True else None
    return [f"training.fused_loss=true cannot run here ({why}): set training.fused_loss=auto"] if why else []


@rule
def hf_model_keys(cfg: Config, world_size: int) -> list[str]:
    """`model.hf_model` (models/hf_auto.py) builds the transformers model from its own config.json: the keys that
    would shape or split another model are refused, never ignored."""
    m, d, t = cfg.model, cfg.distributed, cfg.training
    if not m.hf_model:
        return []
    what = f"with model.hf_model={m.hf_model}"
    given = set(m.overrides()) | {"init_from"} | ({"preset"} if m.preset != "tiny" else set())  # tiny: the default
    out = [f"model.{k} cannot be set {what} (its config.json gives the model): remove it"
           for k in sorted(m.model_fields_set & given)]
    for key, value, on in (("training.fp8.enabled", "true", t.fp8.enabled),  # (fused_loss: `fused_loss_layout`)
                           ("distributed.pp_size", d.pp_size, d.pp_size > 1),
                           ("distributed.cp_size", d.cp_size, d.cp_size > 1),
                           ("distributed.sequence_parallel", "true", d.sequence_parallel)):
        if on:
            out.append(f"{key}={value} is not supported {what} (the transformers model's forward takes token ids "
                       "and returns logits only): remove it")
    if m.init_device == "meta":
        out.append(f"model.init_device=meta {what}: it is built on CPU (its weights load before sharding, and "
                   "transformers computes its buffers, e.g. RoPE frequencies, at construction): set init_device auto")
    return out


@rule
def hf_model_builds(cfg: Config, world_size: int) -> list[str]:
    """A `model.hf_model` transformers can build, that runs on token ids, is causal, can start from the seed and,
    with packing, keeps documents apart (checked by running it when it fits `models.hf_auto.PROBE_PARAMS_MAX`, else
    by the trainer before the first collective) and has blocks."""
    args = _model_args(cfg)
    if not cfg.model.hf_model or args is None:
        return []
    from meshforge.models import probe_model

    try:
        model = probe_model(args)
        if not any(p.is_meta for p in model.parameters()):
            model.check_seeded_start(cfg.run.seed)  # (refused for a parameter with no seeded initialisation)
    except ValueError as err:
        return [str(err)]
    packing = any(s.packing for s in cfg.data.sources())
    problem = packing_problem(args, model) if packing else None  # (a larger model: distributed/build.py)
    if problem:
        return [problem]
    if not cfg.distributed.block_classes and not model.blocks():
        return [f"model.hf_model={cfg.model.hf_model}: {type(model.hf).__name__} declares no blocks (no "
                "_no_split_modules, no ModuleList of layers): set distributed.block_classes to its layer class"]
    return []


@rule
def hf_model_experts(cfg: Config, world_size: int) -> list[str]:
    """Expert parallelism on a `model.hf_model` shards its transformers experts modules (models/hf_auto_moe.py):
    refused for a model without them or with experts meshforge cannot split, and the expert count must divide."""
    d = cfg.distributed
    if not cfg.model.hf_model or d.ep_size == 1 or _model_args(cfg) is None:
        return []
    from meshforge.models import plan_modules

    try:
        problem = plan_modules(cfg.model)[0].expert_parallel_problem(d.ep_size)
    except ValueError:  # a model that cannot be built: hf_model_builds says why
        return []
    return [f"distributed.ep_size={d.ep_size} with model.hf_model={cfg.model.hf_model}: {problem}"] if problem else []


@rule
def fp8_layout(cfg: Config, world_size: int) -> list[str]:
    """training.fp8 runs with every strategy, TP (torchao's float8 styles), CP and PP stages (distributed/float8.py);
    under TP with tensorwise scales only: torchao's per-row scales on tensor-parallel shards are not one process's
    (measured on a column-wise + row-wise pair at tp 2: outputs 3.2e-3 relative apart and weight gradients 2.8%,
    where tensorwise scales agree to 3.4e-7 and exactly)."""
    f, d = cfg.training.fp8, cfg.distributed
    if f.enabled and f.recipe == "rowwise" and d.tp_size > 1:
        return [f"training.fp8.recipe=rowwise with distributed.tp_size={d.tp_size} is not supported (torchao's per-row "
                "scales on tensor-parallel shards differ from one process's): set training.fp8.recipe=tensorwise"]
    return []


@rule
def compile_backend_read(cfg: Config, world_size: int) -> list[str]:
    t = cfg.training
    if t.compile is False and t.compile_backend != "inductor":
        return [f"training.compile_backend={t.compile_backend} is not read with training.compile=false: remove it "
                "or set training.compile=true"]
    return []


_BF16_MASTERS = ("unsharded", "fp32_shards", "replicated", "main_buffers")  # StrategySpec.bf16_params


@rule
def bf16_params_layout(cfg: Config, world_size: int) -> list[str]:
    """bf16_params keeps fp32 master weights where the strategy's spec says (`StrategySpec.bf16_params`):
    "unsharded": in the optimizer beside the bf16 model (world size 1); "fp32_shards": its fp32 shards gathered
    in bf16 over dp*cp > 1, else (nothing but pipeline stages) as unsharded, per stage; "replicated": every dp
    rank's optimizer beside bf16 replicas, the fp32 main gradients averaged by the strategy; "main_buffers": its
    own fp32 main buffers beside bf16 compute buffers. Any other text says why the strategy cannot run it."""
    if cfg.training.precision != "bf16_params":
        return []
    d, fix = cfg.distributed, "set training.precision=bf16 (autocast over fp32 parameters)"
    spec, mode = d.spec, d.spec.bf16_params
    if mode not in _BF16_MASTERS:
        return [f"training.precision=bf16_params: {mode}; {fix}"]
    dp_cp = (dp_size(cfg, world_size) or 1) * d.cp_size
    if mode == "fp32_shards" and dp_cp == 1 and d.tp_size > 1:
        return [f"training.precision=bf16_params with distributed.tp_size={d.tp_size} needs data or context "
                f"parallel size > 1 under {spec.name} (its fp32 shards are the masters): add dp or cp ranks, "
                f"or {fix}"]
    if mode == "unsharded" and world_size > 1:
        able = either([s.name for s in strategy_specs().values() if s.bf16_params in _BF16_MASTERS[1:]])
        return [f"training.precision=bf16_params keeps fp32 master weights in the optimizer of an unwrapped model "
                f"(world size 1) under strategy {d.strategy}, not over {world_size} ranks: set "
                f"distributed.strategy={able}, or {fix}"]
    return spec.bf16_params_rule(cfg, world_size) if spec.bf16_params_rule is not None else []


def check(cfg: Config, world_size: int | None = None) -> list[str]:
    """Every violation, one line each (empty when the config is valid for this world size)."""
    ws = world_size if world_size is not None else default_world_size(cfg)
    if ws < 1:
        return [f"world size must be positive (got {ws})"]
    out: list[str] = []
    for fn in RULES:
        out += fn(cfg, ws)
    return out


def warnings(cfg: Config, world_size: int | None = None) -> list[str]:
    """Accepted but no-op options, and choices meshforge made for the user."""
    d = cfg.distributed
    ws = world_size if world_size is not None else default_world_size(cfg)
    out = []
    if d.pipeline is not None and d.pp_size == 1:
        out.append("distributed.pipeline is ignored because pp_size=1")
    if d.moe is not None and d.ep_size == 1:
        out.append("distributed.moe is ignored because ep_size=1")
    for fn in d.spec.warnings:
        out += fn(cfg, ws)
    if cfg.resilience.max_restarts and not cfg.checkpoint.interval:
        out.append(f"resilience.max_restarts={cfg.resilience.max_restarts} with checkpoint.interval=0: a restart "
                   "finds no checkpoint and starts again from step 0")
    fused = fused_loss_note(cfg)
    if fused:
        out.append(fused)
    out += _ignored_tracking_keys(cfg)
    set_options = sorted(d.options.model_fields_set)
    if ws == 1 and set_options:
        out.append(f"world size 1: strategy {d.strategy} options ({', '.join(set_options)}) have nothing to shard "
                   "or reduce")
    return out


def _ignored_tracking_keys(cfg: Config) -> list[str]:
    """Profiling and logger keys set where nothing reads them."""
    p, lg = cfg.profiling, cfg.logging
    out = [f"profiling.{k} is ignored because profiling.enabled=false"
           for k in sorted(p.model_fields_set - {"enabled"}) if not p.enabled]
    for key, readers in (("project", {"wandb", "mlflow"}), ("mlflow_tracking_uri", {"mlflow"})):
        if key in lg.model_fields_set and not readers & set(lg.loggers):
            out.append(f"logging.{key} is ignored: logging.loggers {lg.loggers} has no "
                       f"{' or '.join(sorted(readers))}")
    return out


def resolved_ckpt_format(cfg: Config) -> str:
    """The checkpoint format actually used: explicit, else the right one for the strategy."""
    return cfg.checkpoint.ckpt_format or cfg.distributed.spec.ckpt_formats[0]


@rule
def validation_data(cfg: Config, world_size: int) -> list[str]:
    """training.val_every and data.validation go together: either alone would do nothing."""
    every, val = cfg.training.val_every, [s.validation for s in cfg.data.sources() if s.validation] or None
    if every and val is None:
        return [f"training.val_every={every} needs data.validation (paths: [files] or fraction: 0.05)"]
    if val is not None and not every:
        return ["data.validation is set but training.val_every=0, so it would never run: set training.val_every"]
    return []


@rule
def live_model_support(cfg: Config, world_size: int) -> list[str]:
    """logging.samples and training.eval_every run the whole sequence through the live model on every rank: not
    through pipeline stages (the schedule drives their forwards) or context parallelism (it splits the sequence)."""
    d, out = cfg.distributed, []
    uses = [(name, instead) for name, on, instead in (
        ("logging.samples", cfg.logging.samples is not None, "generate from a checkpoint with `meshforge generate`"),
        ("training.eval_every", cfg.training.eval_every is not None, "evaluate a checkpoint with `meshforge eval`"))
        if on]
    for name, instead in uses:
        out += [f"{name} with distributed.{k}={v} is not supported yet: {instead} instead"
                for k, v in (("pp_size", d.pp_size), ("cp_size", d.cp_size)) if v > 1]
    if cfg.training.eval is not None and cfg.training.eval.paths:
        if cfg.data.mix:
            out.append("training.eval.paths with data.mix is not supported yet (which source's settings would read "
                       "them?): give each source a validation (data.mix[i].validation) instead")
        elif cfg.data.source not in ("text", "dataset"):
            out.append(f"training.eval.paths are read as data.paths, which data.source={cfg.data.source} does not "
                       "read: evaluate text or dataset files (or drop training.eval.paths)")
    return out


@rule
def packing_support(cfg: Config, world_size: int) -> list[str]:
    """Packed sequences need the document mask in every attention: the dense model's, the context-parallel one
    (which masks its load-balanced chunks with the full document ids), or each pipeline stage's (the ids travel
    with the microbatch); an MoE model also keeps padding out of its router statistics, if its family's model
    takes the ids (`Family.packs_documents`: the default MoE model, DeepSeek-V3's and GPT-OSS's do). Context
    parallelism under pipeline parallelism does not carry them yet: its attention reads the full ids of one micro
    batch at a time, and a pipeline keeps several in flight."""
    if not any(s.packing for s in cfg.data.sources()):
        return []
    d, out = cfg.distributed, []
    if d.pp_size > 1 and d.cp_size > 1:
        out.append(f"data.packing=true with distributed.pp_size={d.pp_size} and cp_size={d.cp_size} is not "
                   "supported yet (context parallelism's document mask holds one micro batch at a time, a pipeline "
                   "several): set cp_size 1 (packing under pp) or pp_size 1 (packing under cp)")
    args = _model_args(cfg)
    problem = packing_problem(args) if args is not None else None  # (a model.hf_model: `hf_model_builds`)
    return out + ([problem] if problem else [])
