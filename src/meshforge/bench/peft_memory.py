"""Per-rank training-state bytes of full fine-tuning vs LoRA, for models too large to run here.

The planner's own accounting (`planning/state.py`, each strategy's terms from its spec), asked for one data-parallel
group of `dp_shards` ranks on CPU (fp32 AdamW): every parameter's bytes (frozen ones too), gradients and optimizer
state (8 bytes per trainable element + a 4-byte `step` per trainable tensor) only for the trainable ones, stored
as the strategy stores them (fsdp2: each parameter's padded dim-0 shard; megatron_fsdp optim_grads_params: per-unit
flat buffers, frozen parameters in a buffer of their own, values only). It equals the bench's measurement byte for
byte (tests/unit/test_lora.py at one rank, tests/unit/test_plan.py per rank); `benchmarks/lora_memory.py` prints it
for large presets.
"""

from __future__ import annotations

import math


def state_bytes(model_cfg, peft_cfg=None, dp_shards: int = 1, strategy: str | None = None,
                rank: int = 0) -> dict[str, int]:
    """{params, grads, optimizer, total, trainable_params, frozen_params} of rank `rank` of `dp_shards`
    (`strategy`: a registered name; None is the schema's default)."""
    from meshforge.config.schema import Config
    from meshforge.planning.layout import Layout
    from meshforge.planning.params import model_params
    from meshforge.planning.state import rank_state

    cfg = Config(model=model_cfg, peft=peft_cfg)
    cfg.training.device = "cpu"
    if strategy is not None:
        cfg.distributed.strategy = strategy
    params, _ = model_params(cfg)
    parts = rank_state(params, cfg, Layout.from_sizes(dp_shards), rank)
    out = {"params": parts.params, "grads": parts.grads, "optimizer": parts.optimizer, "total": parts.total}
    for key, trainable in (("trainable_params", True), ("frozen_params", False)):
        out[key] = sum(math.prod(p.shape) for p in params if p.trainable == trainable)
    return out
