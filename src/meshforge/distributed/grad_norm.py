"""Global gradient norm and clipping that is correct for sharded, tensor-parallel and pipelined grads.

Gradients are grouped by how they are distributed (plain, or DTensor on a given
mesh with given placements); torch computes each group's norm (DTensor
reductions know which shards to sum and which replicas not to double count),
the groups combine as a 2-norm, and pipeline stages add their squares over the
pp group, since each stage holds different parameters.

A parameter's gradient is its fp32 `main_grad` where it has one (training.precision=bf16_params at world size
1: the bf16 gradients are summed there in fp32, master_weights.py), else `p.grad`; both the norm and the
clipping act on that tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _group_key(g: torch.Tensor):
    if isinstance(g, DTensor):
        return (id(g.device_mesh), tuple(g.placements))
    return ("plain", g.device, g.dtype)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will step with: the fp32 main gradient where there is one, else p.grad."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def total_grad_norm(params: list[torch.Tensor], mesh_ctx=None, extra_sq: torch.Tensor | None = None,
                    uncounted: set[int] = frozenset()) -> torch.Tensor:
    """The global 2-norm of `params`' gradients; `uncounted`: ids of parameters left out (a tied weight's second
    copy on another pipeline stage, counted by its first)."""
    grads = [g for g in (grad_of(p) for p in params if id(p) not in uncounted) if g is not None]
    groups: dict = {}
    for g in grads:
        groups.setdefault(_group_key(g), []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for gs in groups.values():
        if gs[0].dtype != torch.float32 and not isinstance(gs[0], DTensor):  # bf16 grads: an fp32 norm, not bf16
            n = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in gs]))
        else:
            n = torch.nn.utils.get_total_norm(gs, 2.0, foreach=None)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.float().to(device) ** 2
    if extra_sq is not None:
        sq = sq + extra_sq
    if mesh_ctx is not None and mesh_ctx.pp_size > 1:
        dist.all_reduce(sq, group=mesh_ctx.group("pp"))
    return sq.sqrt()


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float | None, mesh_ctx=None,
                    uncounted: set[int] = frozenset()) -> torch.Tensor:
    norm = total_grad_norm(params, mesh_ctx, uncounted=uncounted)
    if max_norm is not None:
        grads_params = [p for p in params if p.grad is not None]
        by_key: dict = {}
        for p in grads_params:
            by_key.setdefault(_group_key(p.grad), []).append(p)
        for ps in by_key.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, norm, foreach=None)
        mains = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        if mains:  # the same coefficient as torch's clip_grads_with_norm_, on the fp32 main gradients
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(mains, coef.to(mains[0].device))
    return norm
