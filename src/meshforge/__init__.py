"""meshforge: PyTorch-native training of large language models across many devices, from one YAML file."""

from __future__ import annotations

from meshforge import recipes
from meshforge.config import Config, load_config
from meshforge.errors import ConfigError

__version__ = "0.1.0"


def train(cfg: Config):
    """Train from a Config (validated again here, so attribute edits are checked); returns a TrainResult."""
    from meshforge.distributed.env import env_world_size
    from meshforge.training.trainer import train as _train

    return _train(cfg.validate(world_size=env_world_size()))


def parallelize(model, mesh_ctx, dcfg, device=None):
    """Apply the configured parallelism to any nn.Module (see `meshforge.distributed.setup`)."""
    from meshforge.distributed.parallelize import parallelize as _parallelize

    return _parallelize(model, mesh_ctx, dcfg, device)


def __getattr__(name: str):
    """Subpackages on first use (`meshforge.distributed.setup(...)`): importing meshforge to read a config
    must not load torch.distributed."""
    import importlib

    if name in ("distributed", "models", "data", "training", "checkpoint", "planning", "testing"):
        return importlib.import_module(f"meshforge.{name}")
    raise AttributeError(f"module 'meshforge' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "load_config", "parallelize", "recipes", "train"]
