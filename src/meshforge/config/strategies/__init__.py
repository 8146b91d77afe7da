"""Data-parallel strategies as configuration sees them: one registry of `StrategySpec`s, process-free.

A strategy is a spec plus a runtime:
- the spec (one module per built-in strategy in this package: `ddp.py`, `fsdp2.py`, `megatron_fsdp.py`; its own
  module for a plugin) is everything that can be known before a process starts: the YAML name and aliases, the
  strategy's own options (a pydantic model; the keys are written flat under `distributed:` as in the spec, e.g.
  `distributed.bucket_cap_mb`, and live in `cfg.distributed.options`), which parallelisms it composes with, its
  checkpoint formats (the first is the default), its own rules and warnings, what it supports (frozen LoRA
  parameters, bf16_params), how the planner counts its state and collectives (`plan`, a
  `meshforge.planning.terms.StrategyPlanTerms`), and where its runtime lives;
- the runtime is a `meshforge.distributed.strategy.Strategy` subclass, imported only when a run starts.

Nothing outside a strategy's spec and runtime modules names it: rules, the planner, the bench and the checkpoint
code ask the spec (tests/unit/test_architecture.py checks it). Registering a spec is all it takes: `validate`,
`train`, `verify`, `plan` and `bench` iterate this registry. Another package registers its strategy with an entry
point in the `meshforge.strategies` group whose value names its spec ("module:SPEC"); entry points are loaded the
first time the registry is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

from meshforge.errors import ConfigError
from meshforge.planning.layout import inferred_dp

if TYPE_CHECKING:
    from meshforge.config.schema import Config
    from meshforge.planning.terms import StrategyPlanTerms

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


# Megatron-Bridge's YAML sections (`dist.<key>`, `ddp.<key>`): folded into `distributed` on validation, never dumped
BRIDGE_SECTIONS = frozenset({"dist", "ddp"})

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
    # how `meshforge plan` counts its state and collectives (meshforge.planning.terms); None: not declared, then
    # the plan counts full replicas and says so in a note
    plan: StrategyPlanTerms | None = None
    plan_search: bool = False  # a candidate of `meshforge plan --fit`
    frozen_params: bool = False  # frozen (LoRA base) parameters get no gradient and no optimizer state
    # training.precision=bf16_params: where the fp32 masters live. "unsharded": the optimizer's, beside a model
    # that runs unwrapped (world size 1); "fp32_shards": the strategy's own fp32 shards gathered in bf16 (dp*cp > 1;
    # else unsharded, per pipeline stage); "replicated": every dp rank's optimizer beside bf16 replicas, the fp32
    # main gradients averaged by the strategy; "main_buffers": its own fp32 main buffers beside bf16 compute
    # buffers; any other text says why the strategy cannot run it
    bf16_params: str = "unsharded"
    bf16_params_rule: Rule | None = None  # its own bf16_params checks, once the layout can run it
    flat_buffers: bool = False  # parameters re-stored in flat buffers: model.init_from loads the plain model first
    # Megatron-Bridge keys that select it (`dist.use_megatron_fsdp`), and Bridge keys refused when it is so selected
    bridge_flags: tuple[str, ...] = ()
    bridge_refused: tuple[tuple[str, str], ...] = ()  # (key, "is not supported with ...: fix")
    # `meshforge bench --use-<flag> true`: the performance harness's settings of the spec documents
    harness_flag: str | None = None
    harness_overrides: tuple[str, ...] = ()
    option_keys: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        unknown = set(self.composes_with) - set(AXES)
        if unknown:
            raise ValueError(f"strategy {self.name}: composes_with has unknown axes {sorted(unknown)}; known: {AXES}")
        bridge = [f for f in (*self.bridge_flags, *(k for k, _ in self.bridge_refused))
                  if f.split(".", 1)[0] not in BRIDGE_SECTIONS or "." not in f]
        if bridge:
            raise ValueError(f"strategy {self.name}: Bridge keys are `dist.<key>` or `ddp.<key>`, not {bridge[0]!r}")
        object.__setattr__(self, "option_keys", frozenset(self.options.model_fields) | set(self.options.aliases))


_SPECS: dict[str, StrategySpec] = {}
# `meshforge bench --use-<flag>`: flag -> overrides (the strategy first); kept beside the registry so that a flag
# whose strategy is not registered any more still names it (and validation says it is unknown)
HARNESS_FLAGS: dict[str, tuple[str, ...]] = {}
_plugins_loaded = False
_plugin_error: ConfigError | None = None


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add a strategy; a name (or alias) that is taken already is refused, never silently replaced."""
    taken = {n: s.name for s in _SPECS.values() for n in (s.name, *s.aliases)}
    clash = [n for n in (spec.name, *spec.aliases) if n in taken]
    if clash:
        raise ValueError(f"strategy {spec.name!r}: the name {clash[0]!r} is taken by strategy {taken[clash[0]]!r}")
    _SPECS[spec.name] = spec
    if spec.harness_flag:
        HARNESS_FLAGS[spec.harness_flag] = (f"distributed.strategy={spec.name}", *spec.harness_overrides)
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


def either(names: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def dp_size(cfg: Config, world_size: int) -> int | None:
    """world / (tp * pp * cp), or None when it does not divide (the rules and the strategies' own rules)."""
    d = cfg.distributed
    return inferred_dp(world_size, d.tp_size, d.pp_size, d.cp_size)


# the built-in strategies, in the order `verify` and the error messages list them
from meshforge.config.strategies import ddp, fsdp2, megatron_fsdp  # noqa: E402,F401
