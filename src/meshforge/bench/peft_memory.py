"""Per-rank training-state bytes of full fine-tuning vs LoRA, computed from the model's shapes (meta device).

fp32 AdamW, what the bench's storage accounting (`measure.state_bytes`) measures after an optimizer step:
every parameter 4 bytes (frozen ones too), a gradient of 4 bytes per trainable element, and optimizer state of
8 bytes per trainable element (exp_avg, exp_avg_sq) plus a 4-byte `step` tensor per trainable parameter. A
frozen parameter has neither gradient nor optimizer state. Sharded over `dp_shards` ranks (fsdp2), each
parameter keeps its dim-0 chunk, ceil(d0 / N) rows (FSDP2 pads to that). At one rank the prediction equals the
measurement byte for byte (tests/unit/test_lora.py); `benchmarks/lora_memory.py` prints it for large presets
that do not fit this machine.
"""

from __future__ import annotations

import math

from meshforge.models import build_model
from meshforge.models.lora import apply_lora


def state_bytes(model_cfg, peft_cfg=None, dp_shards: int = 1) -> dict[str, int]:
    """{params, grads, optimizer, total, trainable_params, frozen_params} per rank."""
    model = build_model(model_cfg, device="meta")
    if peft_cfg is not None:
        apply_lora(model, peft_cfg)
    out = dict.fromkeys(("params", "grads", "optimizer", "trainable_params", "frozen_params"), 0)
    for p in model.parameters():  # tied weights once
        rows = math.ceil(p.shape[0] / dp_shards) if p.dim() else 1
        local = rows * (p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1)
        out["params"] += 4 * local
        if p.requires_grad:
            out["grads"] += 4 * local
            out["optimizer"] += 8 * local + 4
            out["trainable_params"] += p.numel()
        else:
            out["frozen_params"] += p.numel()
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
