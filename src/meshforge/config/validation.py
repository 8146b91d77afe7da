"""From a raw mapping to a validated Config: Bridge spellings folded, one line per schema error, then every
cross-field rule. `Config.validate()` and `load_config` both come here.

Every pydantic error becomes one line naming the key; unknown keys get a "did you mean" from the schema's
own field names (and, under `distributed`, the registered strategies' option keys, which are written there).
This module takes the schema class as an argument, so the schema can call it without an import cycle.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from meshforge.config import rules
from meshforge.config.strategies import StrategyOptions, canonical_name, strategy_specs
from meshforge.errors import ConfigError


def quote(value: Any, limit: int = 200) -> str:
    """repr() of a value for an error line, cut to `limit` characters (a pasted list or an alias-expanded
    value can be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _fold_bridge(raw: dict, strict: bool = True) -> tuple[dict, list[str]]:
    """Map Megatron-Bridge `dist:` / `ddp:` keys onto `distributed` (and check their exclusivity rules)."""
    problems: list[str] = []
    raw = dict(raw)
    ckpt = raw.get("checkpoint")
    if isinstance(ckpt, dict) and ("save" in ckpt or "load" in ckpt):  # Bridge: checkpoint.save / .load
        ckpt = dict(ckpt)
        for bridge, ours in (("save", "dir"), ("load", "resume")):
            if bridge not in ckpt:
                continue
            value = ckpt.pop(bridge)
            if ours in ckpt and ckpt[ours] != value:
                problems.append(f"checkpoint.{bridge}={quote(value)} and checkpoint.{ours}={quote(ckpt[ours])} "
                                f"name the same setting differently: keep one")
            ckpt[ours] = value
        raw["checkpoint"] = ckpt
    dist = raw.pop("dist", None) or {}
    ddp = raw.pop("ddp", None) or {}
    if not isinstance(dist, dict) or not isinstance(ddp, dict):
        bad = "dist" if not isinstance(dist, dict) else "ddp"
        return raw, problems + [f"{bad}: must be a section of keys, got {quote(dist if bad == 'dist' else ddp)}"]
    dist, ddp = dict(dist), dict(ddp)
    if not dist and not ddp:
        return raw, problems
    d = raw.get("distributed") or {}
    if not isinstance(d, dict):
        return raw, problems + [f"distributed: must be a section of keys, got {quote(d)}"]
    d = dict(d)
    explicit = canonical_name(d["strategy"]) if isinstance(d.get("strategy"), str) else None
    sections = {"dist": dist, "ddp": ddp}
    # (section, key, strategy) of every registered strategy's Bridge flags; the last registered wins a tie
    flags = [(*flag.split(".", 1), spec.name) for spec in reversed(strategy_specs().values())
             for flag in spec.bridge_flags]
    for section, key, implied in flags:
        if strict and sections[section].get(key) is True and explicit not in (None, implied):
            problems.append(f"{section}.{key}=true asks for strategy {implied} but distributed.strategy="
                            f"{d['strategy']}: remove one of the two keys")
    for section, keys in sections.items():
        on = {}  # strategy -> the first of its flags set in this section
        for sec, key, implied in flags:
            if sec == section and keys.get(key):
                on.setdefault(implied, f"{section}.{key}")
        if len(on) > 1:
            problems.append(f"{' and '.join(on.values())} are mutually exclusive: set one of them false")
    chosen = next((implied for section, key, implied in flags if sections[section].get(key)), None)
    for section, key, _ in flags:
        sections[section].pop(key, None)
    for spec in strategy_specs().values():
        for flag, why in spec.bridge_refused:
            section, key = flag.split(".", 1)
            if sections[section].pop(key, False) and chosen == spec.name:
                problems.append(f"{flag} {why}")
    if chosen is not None:
        d["strategy"] = chosen
    for key, value in ddp.items():
        if value is not None:
            d[key] = value
    for key in dist:
        problems.append(f"dist.{key} is not a known Megatron-Bridge key meshforge maps")
    raw["distributed"] = d
    return raw, problems


def _did_you_mean(model: type[BaseModel], loc: tuple) -> str:
    """Walk the schema along `loc` and suggest the closest field name for its last element."""
    node: Any = model
    for part in loc[:-1]:
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return ""
        ann = field.annotation
        for cand in (ann, *getattr(ann, "__args__", ())):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                node = cand
                break
        else:
            return ""
    names = list(getattr(node, "model_fields", {}))
    options = getattr(node, "model_fields", {}).get("options")
    if options is not None and StrategyOptions in getattr(options.annotation, "__mro__", ()):
        names += sorted({k for spec in strategy_specs().values() for k in spec.option_keys})  # written flat
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return f" (did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))!r}?)" if close else ""


def format_validation_error(err: ValidationError, model: type[BaseModel]) -> list[str]:
    lines = []
    for e in err.errors():
        # `options` is where the strategy's flat keys live: name them as they are written
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal[")))
                    and p != "options")
        key = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_did_you_mean(model, loc)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if msg.startswith(key + "."):  # the message names its keys already (one line each)
            lines += msg.splitlines()
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            lines.append(f"{key}: {quote(msg)[1:-1] if len(msg) > 400 else msg} (got {quote(e['input'])})")
        else:
            lines.append(f"{key}: {msg}")
    return lines


def resolve(raw: dict, schema: type[BaseModel], world_size: int | None = None, bridge_strict: bool = True):
    """Raw dict -> validated `schema` instance (a Config); the cross-field rules run too, at `world_size` (or
    the smallest world the config describes). `bridge_strict`: a `dist.use_*` flag and a different explicit
    `distributed.strategy` in one document are an error; `Config.validate()` passes False, as in
    Megatron-Bridge a flag set on a recipe (whose strategy the recipe chose) switches it."""
    if not isinstance(raw, dict):
        raise ConfigError([f"config must be a mapping of sections, got {type(raw).__name__}"])
    raw, problems = _fold_bridge(raw, bridge_strict)
    try:
        cfg = schema.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(problems + format_validation_error(err, schema)) from None
    if problems:
        raise ConfigError(problems)
    violations = rules.check(cfg, world_size)
    if violations:
        raise ConfigError(violations)
    return cfg


