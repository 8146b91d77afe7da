"""Typed configuration: the schema, YAML loading with overrides, and the cross-field rules."""

from meshforge.config.loader import apply_overrides, load_config, resolve
from meshforge.config.schema import Config
from meshforge.errors import ConfigError

__all__ = ["Config", "ConfigError", "apply_overrides", "load_config", "resolve"]
