"""The one config schema of meshforge, in the order a run uses it.

Every section forbids unknown keys, so a typo is an error (with a "did you mean"
from `config.loader`), never a silently ignored option. Single-section checks
live here as validators; checks that need several sections or the world size
live in `config.rules`, which runs before any process group exists.

A key that exists works: options that belong to one strategy only are rejected
when another strategy is chosen (see `DistributedConfig._strategy_options`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------- run
class RunConfig(Section):
    name: str = "meshforge"
    output_dir: str = "runs/default"
    seed: int = 1234


# --------------------------------------------------------------------------- model
class ModelConfig(Section):
    """A preset by name, with any field overridden; `None` keeps the preset's value."""

    preset: str = "tiny"
    vocab_size: int | None = Field(None, gt=0)
    dim: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)  # None = dim / n_heads
    ffn_dim: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    init_std: float | None = Field(None, gt=0)
    # mixture of experts (presets with experts only; see models/moe.py)
    n_experts: int | None = Field(None, gt=0)
    n_shared_experts: int | None = Field(None, ge=0)
    top_k: int | None = Field(None, gt=0)
    moe_ffn_dim: int | None = Field(None, gt=0)
    score_func: Literal["softmax", "sigmoid"] | None = None
    route_norm: bool | None = None
    aux_loss_coeff: float | None = Field(None, ge=0)
    # meta-device construction: parameters are materialised after sharding
    init_device: Literal["auto", "cpu", "meta"] = "auto"
    init_from: str | None = None  # a Hugging Face style safetensors directory

    def overrides(self) -> dict[str, Any]:
        skip = {"preset", "init_device", "init_from"}
        return {k: v for k, v in self.model_dump().items() if k not in skip and v is not None}


# ---------------------------------------------------------------------------- data
class DataConfig(Section):
    source: Literal["synthetic", "text", "tokenized"] = "text"
    # text: files or globs; empty = the Python standard library's own .py sources
    paths: list[str] = Field(default_factory=list)
    # tokenized: a .npy token file (uint16 or uint32) made by `meshforge data prepare`
    path: str | None = None
    max_files: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _source_inputs(self) -> DataConfig:
        if self.source == "tokenized" and not self.path:
            raise ValueError("data.source=tokenized needs data.path (a .npy file from `meshforge data prepare`)")
        if self.source != "tokenized" and self.path:
            raise ValueError(f"data.path is only read by data.source=tokenized (source is {self.source!r}); "
                             "use data.paths for text files")
        if self.source != "text" and self.paths:
            raise ValueError(f"data.paths is only read by data.source=text (source is {self.source!r})")
        return self


# --------------------------------------------------------------------- distributed
class PipelineConfig(Section):
    pp_schedule: str = "1f1b"
    pp_microbatch_size: int = Field(1, gt=0)
    scale_grads_in_schedule: bool = False
    layers_per_stage: int | None = Field(None, gt=0)
    virtual_stages_per_rank: int = Field(1, gt=0)

    @field_validator("pp_schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        key = v.lower().replace("-", "_")
        aliases = {"interleaved1f1b": "interleaved_1f1b", "zerobubble": "zero_bubble", "vschedule": "v_schedule"}
        key = aliases.get(key, key)
        allowed = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "dfs", "v_schedule", "zero_bubble")
        if key not in allowed:
            raise ValueError(f"unknown pp_schedule {v!r}; choose one of {', '.join(allowed)}")
        return key


class MoEParallelConfig(Section):
    reshard_after_forward: bool = False
    ignore_router_for_ac: bool = False
    wrap_outer_model: bool = True


class MixedPrecisionConfig(Section):
    """FSDP2 mixed precision; `None` = meshforge's default for the device (bf16/fp32 on CUDA, fp32 on CPU)."""

    param_dtype: DTypeName | None = None
    reduce_dtype: DTypeName | None = None
    output_dtype: DTypeName | None = None

    @field_validator("param_dtype", "reduce_dtype", "output_dtype", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
_STRATEGY_ALIASES = {"megatron-fsdp": "megatron_fsdp", "mfsdp": "megatron_fsdp", "fsdp": "fsdp2"}

# Options that only one strategy reads. Setting one under another strategy is an error.
STRATEGY_OPTIONS: dict[str, tuple[str, ...]] = {
    "megatron_fsdp": ("data_parallel_sharding_strategy", "average_in_collective", "grad_reduce_in_fp32",
                      "overlap_grad_reduce", "overlap_param_gather", "keep_fp8_transpose_cache",
                      "fsdp_unit_classes"),
    "fsdp2": ("mp_policy", "offload_policy", "reshard_after_forward", "defer_fsdp_grad_sync", "dp_replicate_size"),
    "ddp": ("bucket_cap_mb", "find_unused_parameters", "static_graph"),
}


class DistributedConfig(Section):
    strategy: Literal["fsdp2", "megatron_fsdp", "ddp"] = "fsdp2"
    dp_size: int | None = Field(None, gt=0)  # None = world_size / (tp * pp * cp)
    dp_replicate_size: int | None = Field(None, gt=0)  # HSDP, fsdp2 only
    tp_size: int = Field(1, gt=0)
    pp_size: int = Field(1, gt=0)
    cp_size: int = Field(1, gt=0)
    ep_size: int = Field(1, gt=0)
    sequence_parallel: bool = False
    activation_checkpointing: Literal[False, True, "full", "selective"] = False
    block_classes: list[str] = Field(default_factory=list)  # bring-your-own-model block wrapping
    tp_plan: dict[str, Literal["colwise", "rowwise", "sequence_parallel", "replicate"]] | None = None
    timeout_minutes: float = Field(10.0, gt=0)
    pipeline: PipelineConfig | None = None
    moe: MoEParallelConfig | None = None
    # fsdp2
    defer_fsdp_grad_sync: bool | None = None  # default true
    mp_policy: MixedPrecisionConfig | None = None
    offload_policy: bool | None = None
    reshard_after_forward: bool | None = None  # None = every block but the last
    # megatron_fsdp
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = None
    average_in_collective: bool | None = None
    grad_reduce_in_fp32: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    keep_fp8_transpose_cache: bool | None = None  # accepted; only meaningful with fp8 weights
    fsdp_unit_classes: list[str] | None = None
    # ddp
    bucket_cap_mb: float | None = Field(None, gt=0)
    find_unused_parameters: bool | None = None
    static_graph: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("strategy"), str):
            s = data["strategy"].lower()
            data["strategy"] = _STRATEGY_ALIASES.get(s, s)
        if "zero_dp_strategy" in data:  # Megatron spelling, 0-3
            z = data.pop("zero_dp_strategy")
            if z is not None:
                if not (isinstance(z, int) and 0 <= z <= 3):
                    raise ValueError(f"zero_dp_strategy must be 0, 1, 2 or 3 (got {z!r})")
                data.setdefault("data_parallel_sharding_strategy", SHARDING_STRATEGIES[z])
        for key in ("dp_size", "dp_replicate_size"):  # spec YAML writes `none`
            if isinstance(data.get(key), str) and data[key].lower() in ("none", "null", "auto"):
                data[key] = None
        return data

    @model_validator(mode="after")
    def _strategy_options(self) -> DistributedConfig:
        for strategy, keys in STRATEGY_OPTIONS.items():
            if strategy == self.strategy:
                continue
            for key in keys:
                if key in self.model_fields_set and getattr(self, key) is not None:
                    if key == "dp_replicate_size" and self.dp_replicate_size == 1:
                        continue
                    owner = [s for s, ks in STRATEGY_OPTIONS.items() if key in ks]
                    raise ValueError(f"distributed.{key} belongs to strategy {'/'.join(owner)}, "
                                     f"not to strategy {self.strategy!r}: remove it or set "
                                     f"distributed.strategy={owner[0]}")
        return self

    # resolved values (the defaults meshforge applies when a key is unset)
    @property
    def sharding_strategy(self) -> str:
        return self.data_parallel_sharding_strategy or "optim_grads_params"

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
    name: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_steps: int | None = Field(None, gt=0)  # None = training.max_steps - warmup


# ------------------------------------------------------------------------- training
class TrainingConfig(Section):
    max_steps: int = Field(100, gt=0)
    global_batch_size: int = Field(8, gt=0)  # sequences per optimizer step, whatever the world size
    micro_batch_size: int = Field(2, gt=0)  # sequences per forward pass per data-parallel rank
    seq_len: int = Field(128, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False
    nonfinite: Literal["skip", "stop"] = "stop"
    max_skipped: int = Field(3, gt=0)

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


# -------------------------------------------------------------------------- logging
class LoggingConfig(Section):
    log_every: int = Field(10, gt=0)
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    jsonl: bool = True
    tensorboard: bool = False
    peak_tflops: float | None = Field(None, gt=0)  # override of the device table for MFU

    @field_validator("progress", mode="before")
    @classmethod
    def _progress_none(cls, v: Any) -> Any:
        return "none" if v is None or v is False else v


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
    dist: BridgeDistConfig = Field(default_factory=BridgeDistConfig)
    ddp: BridgeDDPConfig = Field(default_factory=BridgeDDPConfig)

    def validate(self, world_size: int | None = None) -> Config:  # type: ignore[override]
        """Re-validate after attribute edits and fold Bridge spellings; raises ConfigError listing every problem."""
        from meshforge.config.loader import resolve

        return resolve(self.model_dump(exclude_unset=False, round_trip=True), world_size=world_size)
