"""Typed configuration: the schema, YAML loading with overrides, and the cross-field rules."""

from meshforge.config.loader import ConfigError, apply_overrides, load_config, resolve
from meshforge.config.schema import Config

__all__ = ["Config", "ConfigError", "apply_overrides", "load_config", "resolve"]
