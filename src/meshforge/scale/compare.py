"""The plan beside the trace of the same rank: state bytes, peak memory, collective bytes per (mesh axis, kind).

The plan's axis names are mapped to the groups of ranks they stand for (`comm.canonical`), so the same
collective compares equal whichever name each side gives its group (dp_shard_cp is dp_shard when cp is 1).
Bounds asked of the plan (issue 27): state and collective bytes exact, peak within 3%.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.scale.comm import canonical
from meshforge.scale.trace import RankTrace

PEAK_BOUND = 0.03


@dataclass
class Comparison:
    rank: int
    state_plan: dict[str, int]
    state_trace: dict[str, int]
    peak_plan: int
    peak_trace: int
    comm_plan: dict[tuple[str, str], int]
    comm_trace: dict[tuple[str, str], int]

    @property
    def peak_error(self) -> float:
        return (self.peak_plan - self.peak_trace) / self.peak_trace if self.peak_trace else 0.0

    @property
    def state_exact(self) -> bool:
        return self.state_plan == self.state_trace

    @property
    def comm_exact(self) -> bool:
        return self.comm_plan == self.comm_trace

    @property
    def agrees(self) -> bool:
        return self.state_exact and self.comm_exact and abs(self.peak_error) <= PEAK_BOUND

    def problems(self) -> list[str]:
        """One line per disagreement (empty when the plan agrees)."""
        out = []
        if not self.state_exact:
            out.append(f"rank {self.rank} state: plan {self.state_plan}, trace {self.state_trace}")
        if abs(self.peak_error) > PEAK_BOUND:
            out.append(f"rank {self.rank} peak: plan {self.peak_plan:,}, trace {self.peak_trace:,} "
                       f"({100 * self.peak_error:+.2f}%)")
        for key in sorted(set(self.comm_plan) | set(self.comm_trace)):
            a, b = self.comm_plan.get(key, 0), self.comm_trace.get(key, 0)
            if a != b:
                out.append(f"rank {self.rank} {key[0]} {key[1]}: plan {a:,}, trace {b:,}")
        return out


def compare(cfg, trace: RankTrace, device=None, headroom=None) -> Comparison:
    """The plan of `cfg` for the traced rank beside the trace."""
    from meshforge.planning.comm import comm_per_step
    from meshforge.planning.hardware import DEVICES
    from meshforge.planning.params import model_params
    from meshforge.planning.plan import plan

    params, args = model_params(cfg)
    p = plan(cfg, trace.world_size, device or DEVICES["h100"], params=params, args=args, ranks=[trace.rank])
    rp = p.rank(trace.rank)
    comm = canonical(comm_per_step(params, args, cfg, trace.layout, trace.rank), trace.layout, trace.rank)
    return Comparison(trace.rank, {"params": rp.parts.params, "grads": rp.parts.grads,
                                   "optimizer": rp.parts.optimizer}, dict(trace.state), rp.peak,
                      trace.peak["total"], comm, dict(trace.comm))
