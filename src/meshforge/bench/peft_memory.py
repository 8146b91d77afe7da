"""Per-rank training-state bytes of full fine-tuning vs LoRA, computed from the model's shapes (meta device).

fp32 AdamW, what the bench's storage accounting (`measure.state_bytes`) measures after an optimizer step:
every parameter 4 bytes (frozen ones too), a gradient of 4 bytes per trainable element, and optimizer state of
8 bytes per trainable element (exp_avg, exp_avg_sq) plus a 4-byte `step` tensor per trainable parameter. A
frozen parameter has neither gradient nor optimizer state. Sharded over `dp_shards` ranks (fsdp2), each
parameter keeps its dim-0 chunk, ceil(d0 / N) rows (FSDP2 pads to that). At one rank the prediction equals the
measurement byte for byte (tests/unit/test_lora.py); `benchmarks/lora_memory.py` prints it for large presets
that do not fit this machine.

`strategy="megatron_fsdp"` (optim_grads_params, fp32 compute as on CPU) follows its flat buffers instead: per
FSDP unit (each block, then the rest) the trainable parameters form one buffer and the frozen ones another, each
padded to a multiple of N; rank r holds shard r of each: the fp32 main shard (the compute shard aliases it) and
the gradient shard for a trainable buffer, the compute shard only for a frozen one, and AdamW state (8 bytes per
element + a 4-byte step) for each trainable parameter's piece inside its shard.
"""

from __future__ import annotations

import math

from meshforge.distributed.megatron_fsdp.buffers import flat_layout, local_piece
from meshforge.models import blocks_of, build_model
from meshforge.models.lora import apply_lora


def state_bytes(model_cfg, peft_cfg=None, dp_shards: int = 1, strategy: str = "fsdp2",
                rank: int = 0) -> dict[str, int]:
    """{params, grads, optimizer, total, trainable_params, frozen_params} per rank (`rank`: megatron_fsdp only)."""
    model = build_model(model_cfg, device="meta")
    if peft_cfg is not None:
        apply_lora(model, peft_cfg)
    if strategy == "megatron_fsdp":
        return _megatron_fsdp_bytes(model, dp_shards, rank)
    if strategy != "fsdp2":
        raise ValueError(f"state_bytes: strategy {strategy!r} has no accounting here (fsdp2 or megatron_fsdp)")
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


def _megatron_fsdp_bytes(model, world: int, rank: int) -> dict[str, int]:
    """What `MegatronFSDPStrategy.memory_report` counts after a step (optim_grads_params, fp32) on rank `rank`."""
    params = {id(p): p for p in model.parameters()}  # model order, tied weights once
    blocks = blocks_of(model, None)
    owner: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner.setdefault(id(p), i)
    units: dict[tuple[int, bool], list] = {}
    for pid, p in params.items():
        units.setdefault((owner.get(pid, len(blocks)), p.requires_grad), []).append(p)
    out = dict.fromkeys(("params", "grads", "optimizer", "trainable_params", "frozen_params"), 0)
    for (_, trainable), ps in units.items():
        offsets, _, shard = flat_layout([p.numel() for p in ps], world)
        out["params"] += 4 * shard
        out["trainable_params" if trainable else "frozen_params"] += sum(p.numel() for p in ps)
        if not trainable:
            continue
        out["grads"] += 4 * shard
        for off, p in zip(offsets, ps):
            a, b = local_piece(off, p.numel(), rank * shard, (rank + 1) * shard)
            out["optimizer"] += 8 * (b - a) + 4 if b > a else 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
