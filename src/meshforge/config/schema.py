"""The one config schema of meshforge, in the order a run uses it.

Every section forbids unknown keys, so a typo is an error (with a "did you mean"
from `config.loader`), never a silently ignored option. Single-section checks
live here as validators; checks that need several sections or the world size
live in `config.rules`, which runs before any process group exists.

A key that exists works: options that belong to one strategy only are rejected
when another strategy is chosen (see `DistributedConfig._strategy_keys`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from meshforge.config.strategies import (  # noqa: F401 - BRIDGE_SECTIONS: the schema's readers import it here
    BRIDGE_SECTIONS,
    StrategyOptions,
    StrategySpec,
    canonical_name,
    StrictSection,
    get_strategy,
    option_owners,
    strategy_specs,
)
from meshforge.config.validation import resolve
from meshforge.models.args import Arg, model_fields


class Section(StrictSection):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def set_values(model: BaseModel) -> dict:
    """The values the user set (by YAML, override or attribute assignment), sections included when anything
    inside them was set: re-validating them keeps "unset" meaning unset (rules ask it, e.g. pipeline stages)."""
    out = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            inner = set_values(value)
            if name in model.model_fields_set or inner:
                out[name] = inner
        elif name in model.model_fields_set:
            out[name] = value
    if isinstance(model, DistributedConfig):
        out.update(out.pop("options", {}))  # strategy keys are written flat
    return out


# ----------------------------------------------------------------------------- run
class RunConfig(Section):
    name: str = "meshforge"
    output_dir: str = "runs/default"
    seed: int = Field(1234, ge=0, lt=2**64)  # torch, numpy and random all take it: 0 .. 2**64-1
    # a fresh run (checkpoint.resume=none) into an output_dir that holds a run is refused unless this is true:
    # then the old run is moved aside to <output_dir>.replaced-<UTC time> (training/rundir.py)
    overwrite: bool = False


# --------------------------------------------------------------------------- model
class _ModelSection(Section):
    def overrides(self) -> dict[str, Any]:
        """The preset's fields this section sets (everything but the keys below the overrides)."""
        return {k: v for k, v in self.model_dump().items() if k in _OVERRIDES and v is not None}


def _override(arg: Arg) -> tuple[Any, Any]:
    """A model field as an optional key (None keeps the preset's value), with its bound or choices."""
    kind = Literal[arg.choices] if arg.choices else arg.type
    return kind | None, Field(None, gt=arg.gt, ge=arg.ge, description=arg.doc)


# every model field is declared once, in models/args.py (type, default, bound, doc), and overrides the preset here
_OVERRIDES = {a.name: _override(a) for a in model_fields() if a.name != "hf_model"}  # hf_model: its own key below
ModelConfig = create_model(
    "ModelConfig", __base__=_ModelSection, __module__=__name__,
    __doc__="A preset by name, with any field overridden; `None` keeps the preset's value.",
    preset=(str, "tiny"),
    **_OVERRIDES,
    # meta-device construction: parameters are materialised after sharding
    init_device=(Literal["auto", "cpu", "meta"], "auto"),
    # an HF safetensors directory; its config.json must match the model.* values
    init_from=(str | None, None),
    # any transformers causal LM: its folder (with safetensors: its weights) or a config.json (seeded random
    # init); replaces preset and the shape keys above (docs/hf.md; needs meshforge[hf])
    hf_model=(str | None, None),
)


# ---------------------------------------------------------------------------- peft
class PeftConfig(Section):
    """Parameter-efficient fine-tuning (models/lora.py): adapters train, the base weights are frozen and get
    neither gradients nor optimizer state; checkpoints hold the trainable parameters only."""

    method: Literal["lora"] = "lora"
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input only
    # roles of the model contract (Hugging Face module names, as PEFT writes them) or fnmatch patterns ("*_proj");
    # MoE models: `experts.gate_up_proj` / `experts.down_proj` add per-expert adapters (PEFT's target_parameters)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      min_length=1)
    # base modules kept frozen besides the adapted linears; remove one to train it fully
    freeze: list[Literal["embeddings", "norms"]] = Field(default_factory=lambda: ["embeddings", "norms"])
    init_from: str | None = None  # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)


# ---------------------------------------------------------------------------- data
class ValidationDataConfig(Section):
    """Held-out data for `training.val_every`: separate files read like the training data, or a fraction."""

    paths: list[str] = Field(default_factory=list)  # files/globs of the training source's kind and format
    fraction: float | None = Field(None, gt=0, lt=1)  # or: this share of the training samples (a fixed split)
    batches: int = Field(4, gt=0)  # global batches per validation (the first ones, in order, unshuffled)

    @model_validator(mode="after")
    def _one_kind(self) -> ValidationDataConfig:
        if bool(self.paths) == (self.fraction is not None):
            raise ValueError("data.validation needs exactly one of paths (files) or fraction (held out)")
        return self


class SourceConfig(Section):
    """What one data source reads and how its samples are shaped: `data` itself, or one entry of `data.mix`."""

    # dataset: records from local jsonl/json, parquet, arrow files or `datasets` save_to_disk folders (data.paths)
    source: Literal["synthetic", "text", "tokenized", "dataset"] = "text"
    # text: files or globs; empty = the Python standard library's own .py sources. dataset: record files/folders
    paths: list[str] = Field(default_factory=list)
    # tokenized: a .npy token file (uint16 or uint32) made by `meshforge data prepare`
    path: str | None = None
    # text: read only the first max_files files
    max_files: int | None = Field(None, gt=0)
    # dataset records: text (pre-training on `text_field`), chat ({messages}) or prompt_completion
    format: Literal["text", "chat", "prompt_completion"] = "text"
    text_field: str = "text"
    # chat / prompt_completion: labels on the answers only (assistant turns; completion + EOS) or on every token
    loss_on: Literal["answer", "all"] = "answer"
    # chat / prompt_completion: an example over training.seq_len+1 tokens keeps its first seq_len+1, or is dropped
    too_long: Literal["truncate", "drop"] = "truncate"
    # chat / prompt_completion: pack several examples per sequence; attention stays within each, positions restart
    packing: bool = False
    # held-out data evaluated every training.val_every steps (val_loss, val_ppl)
    validation: ValidationDataConfig | None = None
    # dataset + format text: read and tokenize the records while training, in file order (no shuffle), never
    # holding the corpus in memory; every dp rank reads the whole stream (docs/data.md)
    streaming: bool = False

    @model_validator(mode="after")
    def _source_inputs(self) -> SourceConfig:
        if self.source == "tokenized" and not self.path:
            raise ValueError("data.source=tokenized needs data.path (a .npy file from `meshforge data prepare`)")
        if self.source != "tokenized" and self.path:
            raise ValueError(f"data.path is only read by data.source=tokenized (source is {self.source!r}); "
                             "use data.paths for text files")
        if self.source not in ("text", "dataset") and self.paths:
            raise ValueError(f"data.paths is only read by data.source=text or dataset (source is {self.source!r})")
        if self.source == "dataset" and not self.paths:
            raise ValueError("data.source=dataset needs data.paths (jsonl/parquet/arrow files or a saved dataset)")
        if self.source == "synthetic" and (getattr(self, "tokenizer", None) or self.validation):
            raise ValueError("data.tokenizer and data.validation are not read by data.source=synthetic")
        if self.source == "tokenized" and self.validation and len(self.validation.paths) > 1:
            raise ValueError("data.validation.paths: data.source=tokenized reads one .npy file")
        if self.streaming and self.validation and self.validation.fraction is not None:
            raise ValueError("data.validation.fraction needs random access to the samples; with data.streaming "
                             "give data.validation.paths")
        unread = {"format": self.source != "dataset", "text_field": self.format != "text" or self.source != "dataset",
                  "loss_on": self.format == "text", "too_long": self.format == "text",
                  "packing": self.format == "text", "streaming": self.format != "text" or self.source != "dataset",
                  "max_files": self.source != "text"}
        for key, not_read in unread.items():  # a default value is harmless (a dumped config.yaml spells them all)
            if not_read and key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].default:
                default = type(self).model_fields[key].default
                raise ValueError(f"data.{key} is not read with data.source={self.source} data.format={self.format}: "
                                 f"remove it (it is {getattr(self, key)!r}) or override "
                                 f"data.{key}={'null' if default is None else str(default).lower()}")
        return self


SOURCE_KEYS = tuple(SourceConfig.model_fields)  # what a `data.mix` entry sets for itself (the rest is shared)


class MixSourceConfig(SourceConfig):
    """One source of `data.mix`: its own files, format, fields, loss masking and validation, and its weight."""

    name: str | None = None  # in metrics (mix/<name>, val_loss/<name>); None = source<i>
    weight: float  # its share of the samples: weight / the sum of the weights (any positive scale)

    @field_validator("weight", mode="before")
    @classmethod
    def _a_number(cls, v: Any) -> Any:
        import math

        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"must be a positive number (a source's share of the samples), got {v!r}")
        return v


class DataConfig(SourceConfig):
    # a local tokenizer.json or Hugging Face tokenizer folder; None = byte-level (vocab 256, documents end in NUL)
    tokenizer: str | None = None
    # background worker processes building each step's batches ahead of it (torchdata StatefulDataLoader, in the
    # checkpoint); 0 = built in the step, in the training process. Which batches, and their order, never change
    num_workers: int = Field(0, ge=0)
    # batches each worker keeps ready (read with num_workers > 0)
    prefetch_factor: int = Field(2, gt=0)
    # weighted mixing (data/mix.py): several sources, each with the keys above its own, blended by weight; it
    # replaces the source keys here (tokenizer, num_workers and prefetch_factor stay shared)
    mix: list[MixSourceConfig] | None = None

    @model_validator(mode="after")
    def _shared(self) -> DataConfig:
        if self.num_workers == 0 and self.prefetch_factor != type(self).model_fields["prefetch_factor"].default:
            raise ValueError(f"data.prefetch_factor={self.prefetch_factor} is only read with data.num_workers > 0")
        if any(s.streaming for s in self.sources()) and self.num_workers > 1:
            raise ValueError(f"data.streaming reads one stream in order: data.num_workers={self.num_workers} "
                             "must be 0 or 1")
        if self.mix is None:
            return self
        if not self.mix:
            raise ValueError("data.mix is empty: list the sources to blend (each with a weight), or remove it")
        own = sorted(k for k in SOURCE_KEYS if k in self.model_fields_set  # (a dumped config spells the defaults)
                     and getattr(self, k) != SourceConfig.model_fields[k].get_default(call_default_factory=True))
        if own:
            raise ValueError(f"data.{own[0]} is set next to data.mix: with data.mix every source's keys go in its "
                             f"own entry (data.mix[i].{own[0]})")
        names = self.mix_names()
        if len(set(names)) < len(names):
            raise ValueError(f"data.mix names must differ (got {', '.join(names)})")
        return self

    def sources(self) -> list[SourceConfig]:
        """The sources this section reads: the mix's entries, or itself."""
        return list(self.mix) if self.mix else [self]

    def mix_names(self) -> list[str]:
        return [m.name or f"source{i}" for i, m in enumerate(self.mix or [])]

    def source_config(self, i: int) -> DataConfig:
        """Mix entry i as a data section of its own (the shared keys and that entry's source keys)."""
        own = self.mix[i].model_dump(include=set(SOURCE_KEYS), exclude_unset=True)
        shared = {} if self.mix[i].source == "synthetic" else {"tokenizer": self.tokenizer}  # (reads no tokens)
        return DataConfig.model_validate({**shared, **own})


# --------------------------------------------------------------------- distributed
class PipelineConfig(Section):
    pp_schedule: str = "1f1b"
    pp_microbatch_size: int = Field(1, gt=0)
    scale_grads_in_schedule: bool = False
    layers_per_stage: int | None = Field(None, gt=0)
    virtual_stages_per_rank: int = Field(1, gt=0)
    # uneven ends (Llama 3 405B: 0 and 0, the first stage the embedding only, the last the final norm and head only):
    # blocks on the first / last stage; the other stages share the rest (planning/pipeline_plan.py)
    first_stage_layers: int | None = Field(None, ge=0)
    last_stage_layers: int | None = Field(None, ge=0)

    @field_validator("pp_schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        key = v.lower().replace("-", "_")
        aliases = {"interleaved1f1b": "interleaved_1f1b", "zerobubble": "zero_bubble", "vschedule": "v_schedule",
                   "dual_pipe_v": "dualpipev"}
        key = aliases.get(key, key)
        allowed = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "dfs", "v_schedule", "zero_bubble", "dualpipev")
        if key not in allowed:
            raise ValueError(f"unknown pp_schedule {v!r}; choose one of {', '.join(allowed)}")
        return key


class MoEParallelConfig(Section):
    reshard_after_forward: bool = False
    ignore_router_for_ac: bool = False
    wrap_outer_model: bool = True


class DistributedConfig(Section):
    """Sizes and parallelisms every strategy shares, plus the chosen strategy's own options.

    The strategy's keys are written flat here (`distributed.bucket_cap_mb`, as in the spec) and validated by the
    strategy's options model (`config/strategies/`) into `options`; a key of another strategy is an error
    naming its owner. Reading or assigning such a key on this object reaches `options`.
    """

    strategy: str = "fsdp2"  # a registered strategy or alias: see config/strategies/
    dp_size: int | None = Field(None, gt=0)  # None = world_size / (tp * pp * cp)
    dp_replicate_size: int | None = Field(None, gt=0)  # HSDP: replicas of the sharded group
    tp_size: int = Field(1, gt=0)
    pp_size: int = Field(1, gt=0)
    cp_size: int = Field(1, gt=0)
    ep_size: int = Field(1, gt=0)
    sequence_parallel: bool = False
    activation_checkpointing: Literal[False, True, "full", "selective"] = False
    block_classes: list[str] = Field(default_factory=list)  # bring-your-own-model block wrapping
    tp_plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "replicate"]] | None = None
    timeout_minutes: float = Field(10.0, gt=0)
    # multi-node (`--nnodes`): how long a node waits at the rendezvous for the others before it gives up (exit 4)
    rendezvous_timeout_s: int = Field(600, gt=0, le=86400)
    pipeline: PipelineConfig | None = None
    moe: MoEParallelConfig | None = None
    options: SerializeAsAny[StrategyOptions] = Field(default_factory=StrategyOptions)

    @model_validator(mode="before")
    @classmethod
    def _strategy_keys(cls, data: Any) -> Any:
        """Canonical strategy name; flat strategy keys -> `options`; another strategy's key is an error."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("dp_size", "dp_replicate_size"):  # spec YAML writes `none`
            if isinstance(data.get(key), str) and data[key].lower() in ("none", "null", "auto"):
                data[key] = None
        if isinstance(data.get("strategy"), str):
            data["strategy"] = canonical_name(data["strategy"])
        name = data.get("strategy", "fsdp2")
        mine = get_strategy(name).option_keys if name in strategy_specs() else frozenset()
        options = data.get("options")
        options = dict(options) if isinstance(options, dict) else {}
        foreign = []
        fields = cls.model_fields  # once: a class property that pydantic computes on every read
        for key in [k for k in data if k not in fields]:
            owners = option_owners(key)
            if key in mine:
                options[key] = data.pop(key)
            elif owners and data[key] is not None:
                foreign.append(f"distributed.{key} belongs to strategy {'/'.join(owners)}, not to strategy "
                               f"{name!r}: remove it or set distributed.strategy={owners[0]}")
            elif owners:
                data.pop(key)  # None: the other strategy's default, as a round trip writes it
        if foreign:
            raise ValueError("\n".join(foreign))
        if options or not isinstance(data.get("options"), StrategyOptions):
            data["options"] = options
        return data

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        return get_strategy(v).name

    @field_validator("options", mode="wrap")
    @classmethod
    def _options_of_strategy(cls, v: Any, handler: Any, info: ValidationInfo) -> StrategyOptions:
        name = info.data.get("strategy")
        if name is None:  # the strategy itself failed validation: reported there
            return StrategyOptions()
        model = get_strategy(name).options
        return v if isinstance(v, model) else model.model_validate(v if isinstance(v, dict) else {})

    @model_serializer(mode="wrap")
    def _flat_options(self, handler: Any) -> dict:
        """Dump the strategy's keys flat, as they are written."""
        out = handler(self)
        out.update(out.pop("options", None) or {})
        return out

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and (name in type(options).model_fields or hasattr(type(options), name)):
            return getattr(options, name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self).model_fields and name in type(self.options).model_fields:
            setattr(self.options, name, value)
            return
        old = self.__dict__.get("strategy")
        super().__setattr__(name, value)
        if name == "strategy" and not isinstance(self.options, self.spec.options):
            stale = sorted(k for k in self.options.model_fields_set if getattr(self.options, k) is not None)
            if stale:
                new = self.strategy
                super().__setattr__("strategy", old)
                raise ValueError(f"distributed.{stale[0]} belongs to strategy {old}, not to strategy {new!r}: "
                                 "unset it before switching strategies")
            super().__setattr__("options", self.spec.options())

    # resolved values (the defaults meshforge applies when a key is unset)
    @property
    def spec(self) -> StrategySpec:
        return get_strategy(self.strategy)

    @property
    def ac_mode(self) -> str | None:
        return {False: None, True: "full", "full": "full", "selective": "selective"}[self.activation_checkpointing]

    @property
    def pipeline_or_default(self) -> PipelineConfig:
        return self.pipeline or PipelineConfig()

    @property
    def moe_or_default(self) -> MoEParallelConfig:
        return self.moe or MoEParallelConfig()


# ------------------------------------------------------------------------ optimizer
class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"


class SchedulerConfig(Section):
    """Linear warmup, then: cosine/linear decay to min_lr_ratio, constant, or wsd (warmup-stable-decay: the
    peak lr until the last `decay_steps` steps of training.max_steps, then `decay_style` down to min_lr_ratio)."""

    name: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # cosine/linear: steps of decay after warmup (None = training.max_steps - warmup);
    # wsd: length of the final decay phase (required)
    decay_steps: int | None = Field(None, gt=0)
    decay_style: Literal["linear", "cosine", "sqrt"] | None = None  # wsd only; None = linear

    @model_validator(mode="after")
    def _wsd_keys(self) -> SchedulerConfig:
        if self.name != "wsd" and self.decay_style is not None:
            raise ValueError(f"scheduler.decay_style is only read by scheduler.name=wsd (name is {self.name!r}): "
                             "remove it or set scheduler.name=wsd")
        if self.name == "wsd" and self.decay_steps is None:
            raise ValueError("scheduler.name=wsd needs scheduler.decay_steps (the length of the final decay "
                             "phase, e.g. 10-20% of training.max_steps)")
        return self


# ------------------------------------------------------------------------- training
class FP8Config(Section):
    """torchao float8 training of the blocks' linear layers (distributed/float8.py); the output head stays."""

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"  # scaling granularity (fsdp2 float8 all-gather: tensorwise)
    # auto: only matmuls large enough to gain (torchao's H100 thresholds); all: every linear whose dims divide by 16
    filter: Literal["auto", "all"] = "auto"


class EvalConfig(Section):
    """What `training.eval_every` evaluates (training/evaluation.py): `meshforge eval` on the live model, its
    perplexity on held-out files and its scores on local lm-eval tasks, logged as `eval/*` metrics."""

    paths: list[str] = Field(default_factory=list)  # held-out files: perplexity, read as data.* reads training's
    tasks: list[str] = Field(default_factory=list)  # lm-eval task names, found in `include` (extra `eval`)
    include: list[str] = Field(default_factory=list)  # folders of lm-eval task YAML (local files only)
    limit: int | None = Field(None, gt=0)  # at most this many documents per task; None = all

    @model_validator(mode="after")
    def _something(self) -> EvalConfig:
        if not self.paths and not self.tasks:
            raise ValueError("training.eval: no tasks given: set tasks (lm-eval task names, with include: their "
                             "folders) and/or paths (held-out files for perplexity)")
        if self.tasks and not self.include:
            raise ValueError("training.eval.tasks needs training.eval.include: the folders of their task YAML "
                             "files (tasks are read from local files only)")
        if self.include and not self.tasks:
            raise ValueError("training.eval.include is set but training.eval.tasks names no task: name them")
        return self


class TrainingConfig(Section):
    max_steps: int = Field(100, gt=0)
    global_batch_size: int = Field(8, gt=0)  # sequences per optimizer step, whatever the world size
    micro_batch_size: int = Field(2, gt=0)  # sequences per forward pass per data-parallel rank
    seq_len: int = Field(128, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    # fp32; bf16: autocast over fp32 parameters; bf16_params: bf16 parameters and no autocast, with fp32 master
    # weights in the optimizer (world size 1: distributed/master_weights.py) or in fsdp2's shards (it gathers bf16)
    precision: Literal["fp32", "bf16", "bf16_params"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: Literal["auto"] | bool = "auto"  # torch.compile each block (regional); auto: on CUDA, off on CPU
    # torch.compile's backend (torchtitan's compile.backend); aot_eager traces forward and backward as inductor
    # does but runs them with eager kernels (no code generation: seconds, for CI); read only when compile is on
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    # output head + cross-entropy a chunk of tokens at a time, never holding the full logits (models/loss.py);
    # auto: on wherever it applies (a meshforge model, no tensor or pipeline parallelism), else the plain loss
    fused_loss: Literal["auto"] | bool = "auto"
    fp8: FP8Config = Field(default_factory=FP8Config)
    nonfinite: Literal["skip", "stop"] = "stop"
    max_skipped: int = Field(3, gt=0)
    val_every: int = Field(0, ge=0)  # steps between validations (and at the last step) on data.validation; 0 = never
    # steps between evaluations (and at the last step) of training.eval's files and tasks; None = never
    eval_every: int | None = Field(None, gt=0)
    eval: EvalConfig | None = None

    @model_validator(mode="after")
    def _eval_pair(self) -> TrainingConfig:
        if (self.eval_every is None) != (self.eval is None):
            raise ValueError("training.eval_every needs training.eval (what to evaluate: tasks, include, paths) "
                             "and training.eval needs training.eval_every (how often): set both or neither")
        return self

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_alias(cls, v: Any) -> Any:
        return {"float32": "fp32", "bfloat16": "bf16"}.get(v, v) if isinstance(v, str) else v


# ----------------------------------------------------------------------- checkpoint
class CheckpointConfig(Section):
    interval: int = Field(0, ge=0)  # steps between saves; 0 = never (a final save still follows save_final)
    dir: str | None = None  # None = <run.output_dir>/checkpoints
    ckpt_format: Literal["fsdp_dtensor", "torch_dist"] | None = None  # None = right one for the strategy
    keep_last: int | None = Field(None, gt=0)
    async_save: bool = False
    resume: str | None = "auto"  # auto | none | a checkpoint path
    save_final: bool = False
    save_consolidated: Literal[False, "final", "every"] = False
    consolidated_shard_mb: int = Field(2048, gt=0)
    # resume refuses a checkpoint whose model args or tensor names differ from this model's; true loads the
    # tensors both have (fine-tuning a changed model) and starts at step 0 without optimizer state
    allow_partial_load: bool = False
    # resume refuses a checkpoint whose inputs changed since it was saved (data files, tokenizer, validation files,
    # data settings: docs/data.md "fingerprints"), naming the first; true resumes on the changed inputs anyway
    allow_changed_inputs: bool = False
    grace_period_s: float = Field(120.0, gt=0)

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_none(cls, v: Any) -> Any:
        return None if v is None or (isinstance(v, str) and v.lower() in ("none", "null", "false", "")) else v

    @field_validator("ckpt_format", mode="before")
    @classmethod
    def _fmt_none(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.lower() in ("none", "null", "auto") else v

    # Megatron-Bridge spelling: cfg.checkpoint.save = DIR, cfg.checkpoint.load = None | DIR
    @property
    def save(self) -> str | None:
        return self.dir

    @save.setter
    def save(self, value: str | None) -> None:
        self.dir = value

    @property
    def load(self) -> str | None:
        return self.resume

    @load.setter
    def load(self, value: str | None) -> None:
        self.resume = value


# ----------------------------------------------------------------------- resilience
class ResilienceConfig(Section):
    """What a job does about faults at scale (docs/faults.md)."""

    # a failed attempt (any rank failing) restarts the whole job this many times, resuming from the last committed
    # checkpoint (needs checkpoint.resume=auto); the same failure twice in a row ends it. `--max-restarts` sets it
    max_restarts: int = Field(0, ge=0, le=1000)


# -------------------------------------------------------------------------- logging

class SamplesConfig(Section):
    """Text generated from the live model during training (training/samples.py): each prompt's continuation every
    `every` steps (and at the last step), logged as a `samples` record to metrics.jsonl and every logger. It forks
    the RNG and leaves the data order alone, so training and exact resume are unchanged."""

    prompts: list[str] = Field(min_length=1)
    every: int = Field(gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(0.0, ge=0)  # 0: greedy
    top_k: int = Field(0, ge=0)  # 0: off
    top_p: float = Field(1.0, gt=0, le=1)  # 1: off
    seed: int = Field(0, ge=0)
    chat: bool | None = None  # wrap each prompt in the tokenizer's chat template; None: when it has one

    @model_validator(mode="after")
    def _sampling(self) -> SamplesConfig:
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise ValueError("logging.samples: top_k/top_p sample, but temperature is 0 (greedy): set a temperature")
        if any(not p for p in self.prompts):
            raise ValueError("logging.samples.prompts: a prompt is empty")
        return self


class LoggingConfig(Section):
    """Where metrics go (rank 0 only; see training/loggers.py). The old booleans `jsonl: BOOL` and
    `tensorboard: BOOL` are still read, mapped exactly onto `loggers` (true adds the name, false removes it;
    false for a name `loggers` lists is refused as a contradiction)."""

    log_every: int = Field(10, gt=0)
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    # metric sinks: jsonl (<output_dir>/metrics.jsonl), tensorboard, wandb, mlflow (the last three are extras)
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(default_factory=lambda: ["jsonl"])
    project: str = "meshforge"  # the W&B project / MLflow experiment; the run is named run.name
    mlflow_tracking_uri: str | None = None  # None = $MLFLOW_TRACKING_URI, else file:<output_dir>/mlruns
    peak_tflops: float | None = Field(None, gt=0)  # override of the device table for MFU
    # at each log step (more than one rank): the slowest rank by its own time per step (compute + data wait, not
    # time waiting for the others; training/stragglers.py) and its ratio to the median; a warning past this ratio
    straggler_ratio: float | None = Field(1.5, gt=1)  # None: never warn (the fields are still logged)
    samples: SamplesConfig | None = None  # text from the live model every N steps (None: never)

    @model_validator(mode="before")
    @classmethod
    def _old_logger_flags(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not ({"jsonl", "tensorboard"} & set(data)):
            return data
        data = dict(data)
        given = data.get("loggers")
        loggers = list(given or (["jsonl"] if given is None else []))
        for name in ("jsonl", "tensorboard"):
            if name not in data:
                continue
            on = data.pop(name)
            if not isinstance(on, bool):
                raise ValueError(f"logging.{name} must be true or false (it maps onto logging.loggers)")
            if not on and given is not None and name in given:
                raise ValueError(f"logging.{name}=false contradicts logging.loggers={list(given)}: drop "
                                 f"logging.{name} (the old spelling) and list the loggers you want")
            if on and name not in loggers:
                loggers.append(name)
            elif not on:
                loggers = [x for x in loggers if x != name]
        data["loggers"] = loggers
        return data

    @field_validator("loggers")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("progress", mode="before")
    @classmethod
    def _progress_none(cls, v: Any) -> Any:
        return "none" if v is None or v is False else v


# ------------------------------------------------------------------------ profiling
class ProfilingConfig(Section):
    """A torch.profiler trace of a few steps (training/profiling.py)."""

    enabled: bool = False
    steps: tuple[int, int] = (5, 8)  # first and last optimizer step profiled (1-based, inclusive)
    dir: str | None = None  # None = <run.output_dir>/profile; trace_rank<R>.json per rank
    memory_snapshot: bool = False  # CUDA only: a memory-history snapshot (pytorch.org/memory_viz) per rank

    @field_validator("steps")
    @classmethod
    def _ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1]:
            raise ValueError(f"profiling.steps={list(v)} must be [first, last] with 1 <= first <= last")
        return v


# -------------------------------------------------- Megatron-Bridge style spellings


class BridgeDistConfig(Section):
    """`dist:` as in Megatron-Bridge; folded into `distributed` by `Config.validate()`."""

    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    use_tp_pp_dp_mapping: bool = False


class BridgeDDPConfig(Section):
    """`ddp:` as in Megatron-Bridge; its keys map onto `distributed` one to one."""

    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = None
    average_in_collective: bool | None = None
    grad_reduce_in_fp32: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    keep_fp8_transpose_cache: bool | None = None


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    peft: PeftConfig | None = None  # None = full fine-tuning (applied right after the model is built)
    dist: BridgeDistConfig = Field(default_factory=BridgeDistConfig)
    ddp: BridgeDDPConfig = Field(default_factory=BridgeDDPConfig)

    def validate(self, world_size: int | None = None) -> Config:  # type: ignore[override]
        """Re-validate after attribute edits and fold Bridge spellings; raises ConfigError listing every problem."""
        return resolve(set_values(self), type(self), world_size, bridge_strict=False)
