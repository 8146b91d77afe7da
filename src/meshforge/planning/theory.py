"""Textbook estimates the benchmarks print beside their measurements (the planner's exact accounting lives in
`planning/estimate.py`; these are the closed forms, without padding, scalars or per-unit detail).
"""

from __future__ import annotations


def textbook_state(name: str, P: int, N: int) -> dict:
    """Bytes per rank (fp32, AdamW) of params, grads, optimizer, and collective volume per step, for the
    strategies of benchmarks/memory_per_rank.py (ddp, fsdp2, mfsdp_<sharding strategy>) at N ranks."""
    b = 4 * P
    t = {
        "ddp": (b, b, 2 * b, {"all_reduce": b}),
        "fsdp2": (b / N, b / N, 2 * b / N, {"all_gather": 2 * b, "reduce_scatter": b}),
        "mfsdp_no_shard": (b, b, 2 * b, {"all_reduce": b}),
        "mfsdp_optim": (b + b / N, b, 2 * b / N, {"all_reduce": b, "all_gather": b}),
        "mfsdp_optim_grads": (b + b / N, b / N, 2 * b / N, {"reduce_scatter": b, "all_gather": b}),
        "mfsdp_optim_grads_params": (b / N, b / N, 2 * b / N, {"all_gather": 2 * b, "reduce_scatter": b}),
    }[name]
    return {"params": t[0], "grads": t[1], "optimizer": t[2], "comm": t[3]}


def textbook_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Pipeline idle fraction: (p-1)/(m+p-1) with one stage per rank (1f1b, gpipe), (p-1)/(v*m+p-1) with v
    stages per rank (the interleaved estimate)."""
    if p <= 1:
        return 0.0
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    return (p - 1) / (v * m + p - 1)
