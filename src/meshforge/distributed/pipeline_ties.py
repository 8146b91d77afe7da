"""Weights a pipeline split ties across stages (a tied input embedding and output head), kept as torchtitan and
Megatron keep them: the first stage holds the weight under its first name (the embedding's, as the model's tie says),
the last stage a copy under the head's name, and the two stay equal.

- Init: the copy starts from the tied weight's own initial value (`stage_aliases` names it for `init_weights`).
- Every step, after the schedule's backward and the data-parallel reduction, the two gradients are summed
  (`TiedEnds.sum_grads`): the sum is the gradient of the one tied weight, so both ends take the same optimizer step
  from the same state and stay bitwise equal. The sum runs over a group of the two pp ranks that hold the ends (for
  each data/tensor/context-parallel coordinate: the local shards match, both ends being sharded alike), or on one
  rank when a V schedule puts both ends there.
- Gradient norm: the copy is left out (`copies`), so the tied weight counts once, as without PP.
- Checkpoints keep their names: a model state dict holds both names of a tied weight with or without PP, and the
  copy's optimizer state is saved and loaded under the first name (`to_canonical` / `from_canonical`), which is
  where a run without PP keeps it (both ends write the same values; DCP keeps one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.distributed.env import per_world
from meshforge.distributed.grad_norm import grad_of
from meshforge.errors import ConfigError
from meshforge.planning.tp_plan import tied_parameters


def stage_aliases(ties: list[list[str]], stage: nn.Module) -> dict[str, str]:
    """{name in `stage`: the tied weight's first name} for the tied weights (`ties`: the whole model's groups of
    names) whose first name this stage does not hold."""
    here = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
    return {n: group[0] for group in ties if group[0] not in here for n in group if n in here}


def whole_model_ties(model: nn.Module) -> list[list[str]]:
    """The whole model's tied groups (first name first), before it is cut into stages."""
    return tied_parameters(model)


def _pair_group(mesh_ctx, first: int, last: int):
    """The process group of the two pp ranks `first` and `last` at this rank's other coordinates (every rank
    creates every pair's group, in the same order); None on the ranks in between."""

    def make():
        mesh = mesh_ctx.device_mesh
        ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0)
        mine = None
        for pair in ranks[[first, last]].reshape(2, -1).T.tolist():
            group = dist.new_group(pair)
            if mesh_ctx.rank in pair:
                mine = group
        return mine

    return per_world(("pipeline tied ends", mesh_ctx.layout, first, last), make)


def _cloned(entry: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


def _grad_in_param_layout(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer steps with, placed as the parameter is: torch hands a vocabulary-parallel
    embedding a Replicate gradient of its Shard(0) weight (TP without FSDP), while the head's is Shard(0); placed
    alike, the two ends' local tensors match element for element."""
    g = grad_of(p)
    if isinstance(g, DTensor) and isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
        if getattr(p, "main_grad", None) is not None:
            p.main_grad = g
        else:
            p.grad = g
    return g


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class TiedEnds:
    """This rank's part of the weights tied across the first and the last stage (see the module docstring)."""

    def __init__(self, stages: dict[int, nn.Module], ties: list[list[str]], aliases: dict[int, dict[str, str]],
                 num_stages: int, stage_rank, mesh_ctx):
        """`ties`: the whole model's tied groups (the same on every rank: every rank takes part in making the
        groups); `aliases`: this rank's stages' copies (`stage_aliases`)."""
        copies_of = aliases.get(num_stages - 1, {})  # the last stage's copies, if it is here
        self.canonical = sorted(group[0] for group in ties)
        if any(s not in (0, num_stages - 1) for s, a in aliases.items() if a):
            raise ConfigError("model: a weight is tied between pipeline stages other than the first and the last: "
                              "untie it (model.tie_embeddings=false) or use pp_size 1")
        params0 = dict(stages[0].named_parameters(remove_duplicate=False)) if 0 in stages else {}
        last = stages.get(num_stages - 1)
        params_last = dict(last.named_parameters(remove_duplicate=False)) if last is not None else {}
        by_canon = {c: n for n, c in copies_of.items()}
        self.firsts = {c: params0[c] for c in self.canonical if c in params0}
        self.copies = {c: params_last[by_canon[c]] for c in self.canonical if c in by_canon}
        self.copy_names = dict(copies_of)  # {copy name: first name}
        first_rank, last_rank = stage_rank(0), stage_rank(num_stages - 1)
        self.group = None
        if self.canonical and first_rank != last_rank:
            self.group = _pair_group(mesh_ctx, first_rank, last_rank)
        self._param_groups: list | None = None

    def sum_grads(self) -> None:
        """Each end's gradient becomes the sum of both (the tied weight's gradient)."""
        for c in self.canonical:
            mine = [g for g in (_grad_in_param_layout(p) for p in (self.firsts.get(c), self.copies.get(c))
                                if p is not None) if g is not None]
            if len(mine) == 2:  # both ends on this rank (a V schedule)
                mine[0].add_(mine[1])
                mine[1].copy_(mine[0])
            elif len(mine) == 1 and self.group is not None:
                dist.all_reduce(_local(mine[0]), group=self.group)

    def copy_params(self) -> set[int]:
        """ids of the copies: left out of the gradient norm (the first end counts the tied weight)."""
        return {id(p) for p in self.copies.values()}

    # ------------------------------------------------------------------ optimizer checkpoints
    def to_canonical(self, osd: dict) -> dict:
        """An optimizer state dict (`get_optimizer_state_dict`'s) with the copies under the first names."""
        if not self.copy_names:
            return osd
        self._param_groups = [list(g["params"]) for g in osd["param_groups"]]
        state = dict(osd["state"])
        for copy, canon in self.copy_names.items():
            entry = state.pop(copy, None)
            if entry is not None:
                state.setdefault(canon, entry)
        groups = [dict(g, params=list(dict.fromkeys(self.copy_names.get(n, n) for n in g["params"])))
                  for g in osd["param_groups"]]
        return {**osd, "state": state, "param_groups": groups}

    def from_canonical(self, osd: dict) -> dict:
        """The inverse of `to_canonical`, for a load (after `to_canonical` made the template DCP filled)."""
        if not self.copy_names:
            return osd
        state = dict(osd["state"])
        for copy, canon in self.copy_names.items():
            if canon in state:  # both ends here (a V schedule): each keeps its own tensors
                state[copy] = _cloned(state[canon]) if canon in self.firsts else state.pop(canon)
        groups = [dict(g, params=list(p)) for g, p in zip(osd["param_groups"], self._param_groups or [])] \
            if self._param_groups is not None else osd["param_groups"]
        return {**osd, "state": state, "param_groups": groups}
