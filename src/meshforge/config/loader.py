"""YAML loading, `a.b.c=value` overrides, Bridge spellings, and readable errors.

YAML is read with `yaml.safe_load`, so a config can never import or run code.
Every pydantic error becomes one line naming the key; unknown keys get a
"did you mean" from the schema's own field names.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from meshforge.config.schema import Config


class ConfigError(Exception):
    """One or more problems with a config; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _parse_value(text: str) -> Any:
    if text.lower() in ("none", "null", "~"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`training.max_steps=5` style edits; values are parsed as YAML scalars/lists and typed by the schema."""
    raw = dict(raw)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} is not of the form key.path=value")
            continue
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        node = raw
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                problems.append(f"override {path!r}: {k!r} is a value, not a section")
                break
            else:
                child = dict(child)
            node[k] = child
            node = child
        else:
            node[keys[-1]] = _parse_value(value)
    if problems:
        raise ConfigError(problems)
    return raw


def _fold_bridge(raw: dict) -> tuple[dict, list[str]]:
    """Map Megatron-Bridge `dist:` / `ddp:` keys onto `distributed` (and check their exclusivity rules)."""
    problems: list[str] = []
    raw = dict(raw)
    dist = dict(raw.pop("dist", None) or {})
    ddp = dict(raw.pop("ddp", None) or {})
    if not dist and not ddp:
        return raw, problems
    d = dict(raw.get("distributed") or {})
    if dist.get("use_megatron_fsdp") and dist.get("use_torch_fsdp2"):
        problems.append("dist.use_megatron_fsdp and dist.use_torch_fsdp2 are mutually exclusive: set one of them false")
    use_mfsdp = bool(dist.pop("use_megatron_fsdp", False)) | bool(ddp.pop("use_megatron_fsdp", False))
    if dist.pop("use_tp_pp_dp_mapping", False) and use_mfsdp:
        problems.append("dist.use_tp_pp_dp_mapping is not supported with Megatron FSDP: set it false "
                        "(meshforge lays out ranks tp-innermost itself)")
    if dist.pop("use_torch_fsdp2", False) and not use_mfsdp:
        d["strategy"] = "fsdp2"
    if use_mfsdp:
        d["strategy"] = "megatron_fsdp"
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
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return f" (did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))!r}?)" if close else ""


def format_validation_error(err: ValidationError, model: type[BaseModel] = Config) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        key = ".".join(str(p) for p in loc) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key{_did_you_mean(model, loc)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            lines.append(f"{key}: {msg} (got {e['input']!r})")
        else:
            lines.append(f"{key}: {msg}")
    return lines


def resolve(raw: dict, world_size: int | None = None) -> Config:
    """Raw dict -> validated Config; with `world_size`, the cross-field rules run too."""
    if not isinstance(raw, dict):
        raise ConfigError([f"config must be a mapping of sections, got {type(raw).__name__}"])
    raw, problems = _fold_bridge(raw)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(problems + format_validation_error(err)) from None
    if problems:
        raise ConfigError(problems)
    from meshforge.config import rules

    violations = rules.check(cfg, world_size)
    if violations:
        raise ConfigError(violations)
    return cfg


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{p}:{where} is not valid YAML: {getattr(err, 'problem', err)}"]) from None
    return raw or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                world_size: int | None = None) -> Config:
    """Load a YAML file (or the defaults when `path` is None), apply overrides, validate everything."""
    raw = read_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, list(overrides or []))
    return resolve(raw, world_size=world_size)
