"""Regional compilation: `torch.compile` each block, as torchtitan does.

Why per block and not the whole model: every block has the same code, so one compiled graph serves them all
(compile time does not grow with depth), and the hooks that FSDP2, megatron_fsdp and activation checkpointing
put on block boundaries stay outside the compiled region, where they run exactly as in eager mode. Blocks are
compiled after TP/CP/EP and activation checkpointing have rewritten them and before the data-parallel strategy
wraps them (the order in `parallelize_model`).

`training.compile: auto` compiles on CUDA and not on CPU, where inductor's cold compile (~20 s for a tiny model)
costs more than a short run gains. `training.compile_backend` (torchtitan's `compile.backend`): inductor, or
aot_eager, which captures forward and backward through dynamo and AOT autograd exactly as inductor does and runs
the captured graphs with eager kernels: seconds instead of minutes on CPU, so the tests prove that the regions
compose with fsdp2, megatron_fsdp, TP/SP and AC at N=2 (tests/parallel/test_fast_step_parity.py).
"""

from __future__ import annotations

import torch
from torch import nn

from meshforge.distributed.env import policy_device_type


def compile_enabled(setting: bool | str, device: torch.device) -> bool:
    """`training.compile` (true / false / auto) on this device."""
    return policy_device_type(device) == "cuda" if setting == "auto" else bool(setting)


def apply_compile(blocks: list[nn.Module], backend: str = "inductor") -> None:
    """Compile each block in place (its parameter names and hooks stay as they are)."""
    for block in blocks:
        block.compile(backend=backend)
