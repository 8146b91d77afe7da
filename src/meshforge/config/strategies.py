"""Data-parallel strategies as configuration sees them: one registry of `StrategySpec`s, process-free.

A strategy is a spec plus a runtime:
- the spec (below for the built-ins, in its own module for a plugin) is everything that can be known before a
  process starts: the YAML name and aliases, the strategy's own options (a pydantic model; the keys are written
  flat under `distributed:` as in the spec, e.g. `distributed.bucket_cap_mb`, and live in
  `cfg.distributed.options`), which parallelisms it composes with, its checkpoint formats (the first is the
  default), its own rules and warnings, and where its runtime lives;
- the runtime is a `meshforge.distributed.strategy.Strategy` subclass, imported only when a run starts.

Registering a spec is all it takes: `validate`, `train`, `verify` and `bench` iterate this registry. Another
package registers its strategy with an entry point in the `meshforge.strategies` group whose value names its
spec ("module:SPEC"); entry points are loaded the first time the registry is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshforge.errors import ConfigError
from meshforge.planning.layout import inferred_dp

if TYPE_CHECKING:
    from meshforge.config.schema import Config

Rule = Callable[["Config", int], list[str]]
AXES = ("tp", "sp", "cp", "pp", "ep", "hsdp")  # what a strategy may compose with


def _takes_bool(annotation: Any) -> bool:
    args = getattr(annotation, "__args__", None)
    if args is not None:  # Union / Optional / Literal[False, ...]
        return any(a is bool or a is False or a is True or _takes_bool(a) for a in args)
    return annotation is bool or annotation is Any


def _takes_number(annotation: Any) -> bool:
    args = getattr(annotation, "__args__", None)
    if args is not None:
        return any(_takes_number(a) for a in args)
    return annotation in (int, float)


class StrictSection(BaseModel):
    """Base of every config section: YAML's `true` is not a number (pydantic would read it as 1), so a bool
    given for a key that takes numbers, and not bools, is an error naming the key."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: Any) -> Any:
        ann = cls.model_fields[info.field_name].annotation if info.field_name in cls.model_fields else None
        if isinstance(v, bool) and _takes_number(ann) and not _takes_bool(ann):
            raise ValueError(f"must be a number, not the boolean {str(v).lower()}")
        return v


class StrategyOptions(StrictSection):
    """Base of every strategy's own options; `aliases` maps extra accepted spellings onto its keys."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    aliases: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class StrategySpec:
    name: str
    runtime: str | type  # "module:Class" of a meshforge.distributed.strategy.Strategy subclass (or the class)
    options: type[StrategyOptions] = StrategyOptions
    description: str = ""
    aliases: tuple[str, ...] = ()
    composes_with: frozenset[str] = frozenset()
    ckpt_formats: tuple[str, ...] = ("fsdp_dtensor", "torch_dist")  # the first is the default
    shards_parameters: bool = False  # FSDP-like: its collectives overlap compute on side streams
    rules: tuple[Rule, ...] = ()  # (cfg, world_size) -> problems, run with every cross-field rule
    warnings: tuple[Rule, ...] = ()  # (cfg, world_size) -> notes on accepted but no-op settings
    option_keys: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.composes_with) - set(AXES)
        if unknown:
            raise ValueError(f"strategy {self.name}: composes_with has unknown axes {sorted(unknown)}; known: {AXES}")
        object.__setattr__(self, "option_keys", frozenset(self.options.model_fields) | set(self.options.aliases))


_SPECS: dict[str, StrategySpec] = {}
_plugins_loaded = False
_plugin_error: ConfigError | None = None


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add a strategy; a name (or alias) that is taken already is refused, never silently replaced."""
    taken = {n: s.name for s in _SPECS.values() for n in (s.name, *s.aliases)}
    clash = [n for n in (spec.name, *spec.aliases) if n in taken]
    if clash:
        raise ValueError(f"strategy {spec.name!r}: the name {clash[0]!r} is taken by strategy {taken[clash[0]]!r}")
    _SPECS[spec.name] = spec
    return spec


def _load_plugins() -> None:
    """Register the specs of the `meshforge.strategies` entry points; a broken plugin is one ConfigError line."""
    global _plugins_loaded, _plugin_error
    if _plugin_error is not None:
        raise _plugin_error  # every time: a run must not go on as if the plugin did not exist
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in metadata.entry_points(group="meshforge.strategies"):
        try:
            spec = ep.load()
            if not isinstance(spec, StrategySpec):
                raise TypeError(f"{ep.value} is a {type(spec).__name__}, not a StrategySpec")
            register_strategy(spec)
        except Exception as err:  # noqa: BLE001 - whatever a plugin raises, the user gets one line
            first = (str(err).strip().splitlines() or [""])[0]
            _plugin_error = ConfigError(f"strategy plugin {ep.name} (entry point meshforge.strategies: {ep.value}) "
                                        f"failed to load: {type(err).__name__}: {first}; fix or uninstall it")
            raise _plugin_error from None


def strategy_specs() -> dict[str, StrategySpec]:
    _load_plugins()
    return dict(_SPECS)


def canonical_name(name: str) -> str:
    key = str(name).lower()
    for spec in strategy_specs().values():
        if key == spec.name or key in spec.aliases:
            return spec.name
    return key


def get_strategy(name: str) -> StrategySpec:
    specs = strategy_specs()
    key = canonical_name(name)
    if key not in specs:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(specs)}")
    return specs[key]


def option_owners(key: str) -> list[str]:
    """Names of the strategies that declare option `key`."""
    return [s.name for s in strategy_specs().values() if key in s.option_keys]


def _dp(cfg: Config, world_size: int) -> int | None:
    d = cfg.distributed
    return inferred_dp(world_size, d.tp_size, d.pp_size, d.cp_size)


# ====================================================================================== ddp
class DDPOptions(StrategyOptions):
    bucket_cap_mb: float | None = Field(None, gt=0)
    find_unused_parameters: bool | None = None
    static_graph: bool | None = None


def _ddp_static_graph_accumulation(cfg: Config, world_size: int) -> list[str]:
    t, dp = cfg.training, _dp(cfg, world_size)
    if cfg.distributed.options.static_graph and dp and t.global_batch_size // (t.micro_batch_size * dp) > 1:
        return ["distributed.static_graph=true with gradient accumulation: DDP's static graph cannot skip a "
                "reduction, so gradients are all-reduced after every micro-batch (same result, more traffic)"]
    return []


register_strategy(StrategySpec(
    name="ddp", runtime="meshforge.distributed.ddp:DDPStrategy", options=DDPOptions,
    description="torch DistributedDataParallel: full replicas, gradients all-reduced",
    ckpt_formats=("torch_dist", "fsdp_dtensor"), warnings=(_ddp_static_graph_accumulation,)))


# ==================================================================================== fsdp2
DTypeName = Literal["float32", "bfloat16", "float16"]
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


class MixedPrecisionConfig(StrictSection):
    """FSDP2 mixed precision; `None` = meshforge's default for the device (bf16/fp32 on CUDA, fp32 on CPU)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    param_dtype: DTypeName | None = None
    reduce_dtype: DTypeName | None = None
    output_dtype: DTypeName | None = None

    @field_validator("param_dtype", "reduce_dtype", "output_dtype", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return _DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


class FSDP2Options(StrategyOptions):
    mp_policy: MixedPrecisionConfig | None = None
    offload_policy: bool | None = None
    reshard_after_forward: bool | None = None  # None: every block but the last (no resharding under PP)
    defer_fsdp_grad_sync: bool | None = None  # None: true


def _hsdp_sizes(cfg: Config, world_size: int) -> list[str]:
    rep, dp = cfg.distributed.dp_replicate_size, _dp(cfg, world_size)
    if rep is None or rep == 1 or dp is None or not (dp % rep or rep >= dp):
        return []
    return [f"distributed.dp_replicate_size={rep} must divide dp_size={dp} and be smaller than it "
            f"(pure replication is not sharding): choose a proper divisor of {dp}"]


def _cpu_offload(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if not d.options.offload_policy:
        return []
    out = []
    if d.pp_size > 1:
        out.append(f"distributed.offload_policy=true is not supported with pp_size={d.pp_size}: "
                   "set pp_size 1 or turn offloading off")
    if d.ac_mode:
        out.append(f"distributed.offload_policy=true is not supported with activation_checkpointing="
                   f"{d.activation_checkpointing}: turn one of them off")
    return out


def _defer_under_pp(cfg: Config, world_size: int) -> list[str]:
    d = cfg.distributed
    if d.pp_size > 1 and d.options.defer_fsdp_grad_sync is False:
        return ["distributed.defer_fsdp_grad_sync=false has no effect with pp_size>1: the pipeline schedule "
                "reduces gradients once, after its last microbatch"]
    return []


register_strategy(StrategySpec(
    name="fsdp2", runtime="meshforge.distributed.fsdp2:FSDP2Strategy", options=FSDP2Options, aliases=("fsdp",),
    description="torch fully_shard per block, then the root; HSDP on (dp_replicate, dp_shard)",
    composes_with=frozenset(AXES), shards_parameters=True, rules=(_hsdp_sizes, _cpu_offload),
    warnings=(_defer_under_pp,)))


# ============================================================================ megatron_fsdp
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class MegatronFSDPOptions(StrategyOptions):
    aliases: ClassVar[tuple[str, ...]] = ("zero_dp_strategy",)
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = None
    average_in_collective: bool | None = None
    grad_reduce_in_fp32: bool | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    keep_fp8_transpose_cache: bool | None = None  # accepted; only meaningful with fp8 weights
    fsdp_unit_classes: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _zero_dp_strategy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "zero_dp_strategy" in data:  # Megatron spelling, 0-3
            data = dict(data)
            z = data.pop("zero_dp_strategy")
            if z is not None:
                if not (isinstance(z, int) and 0 <= z <= 3):
                    raise ValueError(f"zero_dp_strategy must be 0, 1, 2 or 3 (got {z!r})")
                data.setdefault("data_parallel_sharding_strategy", SHARDING_STRATEGIES[z])
        return data

    @property
    def sharding_strategy(self) -> str:
        return self.data_parallel_sharding_strategy or "optim_grads_params"


def _fp8_cache(cfg: Config, world_size: int) -> list[str]:
    if cfg.distributed.options.keep_fp8_transpose_cache:
        return ["distributed.keep_fp8_transpose_cache only matters with fp8 weights; meshforge keeps weights in "
                "fp32/bf16 (training.fp8 casts them per matmul), so it has no effect"]
    return []


register_strategy(StrategySpec(
    name="megatron_fsdp", runtime="meshforge.distributed.megatron_fsdp:MegatronFSDPStrategy",
    options=MegatronFSDPOptions, aliases=("megatron-fsdp", "mfsdp"),
    description="Megatron-FSDP: flat per-unit buffers, ZeRO 0-3",
    composes_with=frozenset({"tp", "cp"}), ckpt_formats=("fsdp_dtensor",), shards_parameters=True,
    warnings=(_fp8_cache,)))
