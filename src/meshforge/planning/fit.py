"""`meshforge plan --fit`: search layouts (tp, pp, cp, strategy, activation checkpointing, micro batch) for a
world size and device, keep those the config rules accept and whose peak fits memory, fastest first.

The model description is built once and reused by every candidate, so a 70B model at 1024 ranks is searched
in about a second.
"""

from __future__ import annotations

import itertools

from meshforge.planning.estimate import model_params, plan


def _tp_resolved(cfg):
    c = cfg.model_copy(deep=True)
    c.distributed.tp_size = 2  # resolve the TP plan's sharded dims once; tp 1 ignores them
    return model_params(c)


def search(cfg, world_size: int, device, gpus_per_node: int = 8, mfu: float = 0.4):
    """([(choice, Plan)] that fit, fastest first; [(choice, why)] rejected)."""
    from meshforge.config.rules import check

    params, args = _tp_resolved(cfg)
    fits, rejected = [], []
    tps = [t for t in (1, 2, 4, 8) if t <= gpus_per_node and args.n_heads % t == 0 and args.n_kv_heads % t == 0]
    pps = [p for p in (1, 2, 4, 8, 16) if args.n_layers % p == 0]
    cps = [1, 2, 4, 8]
    gbs = cfg.training.global_batch_size
    for tp, pp, cp, strategy, ac, mbs in itertools.product(tps, pps, cps, ("fsdp2", "megatron_fsdp"),
                                                          (False, "selective", "full"), (1, 2, 4)):
        denom = tp * pp * cp
        if world_size % denom:
            continue
        dp = world_size // denom
        choice = (f"{strategy} tp{tp} pp{pp} cp{cp} dp{dp} ac={ac or 'none'} mbs={mbs}")
        if gbs % dp or (gbs // dp) % mbs:
            rejected.append((choice, f"global_batch_size {gbs} does not split into dp {dp} x micro batch {mbs}"))
            continue
        c = cfg.model_copy(deep=True)
        d = c.distributed
        try:
            d.strategy = strategy
        except ValueError as err:
            rejected.append((choice, str(err)))
            continue
        d.tp_size, d.pp_size, d.cp_size, d.dp_size, d.dp_replicate_size = tp, pp, cp, None, None
        d.activation_checkpointing = ac
        d.sequence_parallel = tp > 1
        c.training.micro_batch_size = mbs
        if pp > 1:
            from meshforge.config.schema import PipelineConfig

            d.pipeline = PipelineConfig(pp_schedule="interleaved_1f1b", pp_microbatch_size=mbs,
                                        virtual_stages_per_rank=2) if args.n_layers >= 2 * pp \
                else PipelineConfig(pp_schedule="1f1b", pp_microbatch_size=mbs)
        problems = check(c, world_size)
        if problems:
            rejected.append((choice, problems[0].split(":")[0]))
            continue
        try:
            p = plan(c, world_size, device, gpus_per_node, mfu, params=params, args=args)
        except Exception as err:  # noqa: BLE001 - a layout the planner cannot describe is a rejected layout
            rejected.append((choice, f"{type(err).__name__}: {err}"))
            continue
        if not p.fits:
            rejected.append((choice, "peak memory exceeds the device"))
            continue
        fits.append((choice, p))
    fits.sort(key=lambda cp: cp[1].step_s)
    return fits, rejected
