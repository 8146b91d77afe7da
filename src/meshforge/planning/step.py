"""The step time's parts: compute from the model contract's FLOPs per token, the pipeline bubble of a schedule,
and the seconds a collective takes on a ring over NVLink or the fabric."""

from __future__ import annotations

import dataclasses
import functools

from meshforge.planning.hardware import Device
from meshforge.planning.layout import Layout
from meshforge.planning.theory import textbook_bubble


def bubble_fraction(schedule: str, p: int, m: int, v: int) -> float:
    """Idle fraction of a pipeline schedule: the textbook one (`theory.textbook_bubble`); the zero-bubble
    schedules fill most of it with the weight half of backward (counted as a third of it)."""
    frac = textbook_bubble(schedule, p, m, v)
    return frac / 3 if schedule in ("zero_bubble", "v_schedule") else frac


def _link_bytes_per_s(axis: str, layout: Layout, dev: Device, gpus_per_node: int) -> float:
    """Bandwidth of an axis: NVLink when its groups fit inside one node, the fabric otherwise."""
    span = {"tp": layout.tp, "cp": layout.cp * layout.tp, "dp_shard": layout.dp_shard * layout.cp * layout.tp,
            "dp_shard_cp": layout.dp_shard * layout.cp * layout.tp, "ep": layout.ep * layout.tp,
            "ep_shard": layout.world_size // layout.pp, "dp_cp": layout.world_size // layout.pp,
            "dp": layout.world_size // layout.pp, "dp_replicate": layout.world_size // layout.pp,
            "pp": layout.world_size}.get(axis, layout.world_size)
    return (dev.nvlink_gbps if span <= gpus_per_node else dev.fabric_gbps) * 1e9


def comm_seconds(key: tuple[str, str], n: int, layout: Layout, dev: Device, gpus_per_node: int) -> float:
    """Time of `n` full-buffer bytes of one collective kind on a ring: each rank sends (size-1)/size of the buffer
    for an all-gather, reduce-scatter or all-to-all, twice that for an all-reduce (a reduce-scatter followed by
    an all-gather)."""
    axis, kind = key
    size = _axis_size(axis, layout)
    passes = 2 if kind == "all_reduce" else 1
    return passes * n * (size - 1) / max(size, 1) / _link_bytes_per_s(axis, layout, dev, gpus_per_node)


def _axis_size(axis: str, layout: Layout) -> int:
    if axis == "pp":
        return 2
    return layout.size(axis)


@functools.lru_cache(maxsize=64)
def flops_per_token(args, seq_len: int) -> float:
    """The model contract's FLOPs per token: a built-in model's closed form (models/shapes.py, what the model
    itself answers); an hf_model's from a one-block meta model scaled to the real depth (FLOPs are affine in the
    number of layers: the output head once, the rest per layer)."""
    from meshforge.models import shapes

    if not args.hf_model:
        return shapes.flops_per_token(args, seq_len)
    from meshforge.models import build_model, contract_of

    one = dataclasses.replace(args, n_layers=1)
    per_layer = contract_of(build_model(one, device="meta")).flops_per_token(seq_len) - _head_flops(one)
    return _head_flops(args) + args.n_layers * per_layer


def _head_flops(args) -> float:
    return 6 * args.dim * args.vocab_size
