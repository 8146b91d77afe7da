"""YAML in and out, and `a.b.c=value` overrides; validation is `validation.py`'s.

YAML is read with `yaml.safe_load`, so a config can never import or run code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshforge.config import validation
from meshforge.config.schema import Config
from meshforge.errors import ConfigError


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


def resolve(raw: dict, world_size: int | None = None) -> Config:
    """Raw dict -> validated Config; the cross-field rules run too (see `validation.resolve`)."""
    return validation.resolve(raw, Config, world_size)


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


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML, as it would be written (Bridge sections are folded in already)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude={"dist", "ddp"}), sort_keys=False)


def write_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_yaml(cfg))
