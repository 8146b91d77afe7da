"""YAML in and out, and `a.b.c=value` overrides; validation is `validation.py`'s.

YAML is read with `yaml.safe_load`, so a config can never import or run code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshforge.config import validation
from meshforge.config.validation import quote
from meshforge.config.schema import BRIDGE_SECTIONS, Config
from meshforge.errors import ConfigError


def _parse_value(text: str) -> Any:
    if text.lower() in ("none", "null", "~"):
        return None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError):
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`training.max_steps=5` style edits; values are parsed as YAML scalars/lists and typed by the schema."""
    raw = dict(raw)
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {quote(item)} is not of the form key.path=value")
            continue
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        if not all(keys):
            problems.append(f"override {quote(item)}: {quote(path)} is not a key path like training.max_steps")
            continue
        node = raw
        for k in keys[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                problems.append(f"override {quote(path)}: {quote(k)} is a value, not a section")
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


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key written twice in one mapping (YAML itself keeps the last silently)."""


def _mapping_no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:  # the keys as written (`<<: *alias` merges are flattened in after this)
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (str, int, float, bool)) or key is None:
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quote(key)}: keep one",
                                                        key_node.start_mark)
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_no_duplicates)


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise ConfigError([f"config {str(p)!r} is a directory: give a YAML file (e.g. examples/tiny_cpu.yaml)"])
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError([f"config file {str(p)!r} cannot be read ({type(err).__name__}: {err})"]) from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError([f"{p}:{where} is not valid YAML: {getattr(err, 'problem', err)}"]) from None
    except RecursionError:
        raise ConfigError([f"{p}: is nested too deeply to be a config"]) from None
    if raw is None:
        raise ConfigError([f"config file {str(p)!r} is empty: write at least one section, e.g. `run: {{name: my_run}}` "
                           "(examples/tiny_cpu.yaml is a complete one)"])
    if not isinstance(raw, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of sections (run:, model:, training: ...), "
                           f"not a {type(raw).__name__}"])
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                world_size: int | None = None) -> Config:
    """Load a YAML file (or the defaults when `path` is None), apply overrides, validate everything."""
    raw = read_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, list(overrides or []))
    return resolve(raw, world_size=world_size)


def dump_yaml(cfg: Config) -> str:
    """The resolved config as YAML, as it would be written (Bridge sections are folded in already)."""
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude=BRIDGE_SECTIONS), sort_keys=False)


def write_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_yaml(cfg))
