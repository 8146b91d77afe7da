"""Plain PyTorch models and their declared plans; nothing here imports torch.distributed."""

from __future__ import annotations

import zlib
from typing import Any

from meshforge.models.presets import PRESETS, ModelArgs, preset_is_moe, resolve_model_args

__all__ = ["PRESETS", "ModelArgs", "build_model", "init_weights", "param_init_tensor", "preset_is_moe",
           "resolve_model_args"]


def build_model(model_cfg: Any, device: str | None = None):
    """Build the model a `ModelConfig` describes (on `device`, e.g. "meta"; default CPU), uninitialised."""
    import torch

    args = resolve_model_args(model_cfg)
    if args.is_moe:
        from meshforge.models.moe import MoETransformer as cls
    else:
        from meshforge.models.llama import Llama as cls
    with torch.device(device or "cpu"):
        return cls(args)


def param_init_tensor(model, name: str, shape, seed: int):
    """The full initial value of parameter `name`: a function of (seed, name) only.

    Because it does not depend on how the model is split or in which order
    parameters are visited, a sharded or pipelined model initialises exactly
    like the single-process one.
    """
    import torch

    kind, std = model.init_spec(name)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def init_weights(model, seed: int, copy_fn=None) -> None:
    """Initialise every parameter of a plain (unsharded) model in place from `param_init_tensor`.

    `copy_fn(param, full)` lets the distributed package write a sharded parameter
    from its full value; the default copies into a plain tensor.
    """
    import torch

    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # tied weights: first name wins (tok_embeddings before output)
                continue
            seen.add(id(p))
            full = param_init_tensor(model, name, tuple(p.shape), seed)
            if copy_fn is not None:
                copy_fn(p, full)
            else:
                p.copy_(full.to(dtype=p.dtype, device=p.device))
