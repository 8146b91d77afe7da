"""Textbook estimates the benchmarks print beside their measurements (the planner's exact accounting lives in
`planning/plan.py` and the modules it names; these are the closed forms, without padding or per-unit detail). The
strategies' state per rank in closed form is `benchmarks/memory_per_rank.py`'s table.
"""

from __future__ import annotations


def textbook_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Pipeline idle fraction: (p-1)/(m+p-1) with one stage per rank (1f1b, gpipe), (p-1)/(v*m+p-1) with v
    stages per rank (the interleaved estimate)."""
    if p <= 1:
        return 0.0
    if schedule in ("1f1b", "gpipe"):
        return (p - 1) / (m + p - 1)
    return (p - 1) / (v * m + p - 1)
