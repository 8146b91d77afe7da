"""Activation checkpointing per block: `full` recomputes the whole block, `selective` saves matmul outputs.

The block's forward is wrapped in place (non-reentrant `torch.utils.checkpoint`),
so parameter names do not change (a `checkpoint_wrapper` would insert
`_checkpoint_wrapped_module` into every name and break checkpoints). Selective
mode keeps the outputs of matmuls and attention, the expensive ops, and
recomputes cheap elementwise work (norms, activations, RoPE).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)
if hasattr(torch.ops.higher_order, "flex_attention"):  # packed sequences on CUDA (models/attention.py)
    _SAVE_OPS.add(torch.ops.higher_order.flex_attention)


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn():
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpoint_module(module: nn.Module, mode: str) -> None:
    if getattr(module, "_meshforge_ac", None):
        return
    inner = module.forward
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _context_fn
    elif mode != "full":
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of full, selective")

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kwargs, **kw)

    module.forward = forward
    module._meshforge_ac = mode


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str | None) -> None:
    if mode is None:
        return
    for b in blocks:
        checkpoint_module(b, mode)
