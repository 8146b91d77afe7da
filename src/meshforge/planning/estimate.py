"""The planner's public names, where callers import them from: `meshforge plan` itself is `planning/plan.py`,
which assembles params.py, state.py, activations.py, comm.py and step.py (see its docstring)."""

from meshforge.planning.activations import activation_bytes
from meshforge.planning.activations import alive_peak as _alive_peak
from meshforge.planning.comm import comm_per_step
from meshforge.planning.params import _STAGE_CACHE, ParamRec, model_params
from meshforge.planning.plan import Plan, RankPlan, plan, representative_ranks
from meshforge.planning.state import pipeline_plan_of, rank_state
from meshforge.planning.step import bubble_fraction
from meshforge.planning.terms import Parts

__all__ = ["_STAGE_CACHE", "Parts", "ParamRec", "Plan", "RankPlan", "_alive_peak", "activation_bytes",
           "bubble_fraction", "comm_per_step", "model_params", "pipeline_plan_of", "plan", "rank_state",
           "representative_ranks"]
