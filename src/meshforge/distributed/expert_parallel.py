"""Expert parallelism: experts split over the `ep` mesh, tokens moved to them and back with all-to-all.

`apply_ep(model, mesh_ctx, dcfg, strategy)` runs after TP/CP and before activation checkpointing and the
strategy's `parallelize`. For every MoE layer the model declares (the model contract's `moe_layers()`):

1. The stacked expert parameters (`experts.w1/w2/w3` and any per-expert LoRA factors under the experts
   module, dim 0 = expert) become DTensors `Shard(0)` on the `ep` mesh: ep rank j holds experts
   [j*E/ep, (j+1)*E/ep). Checkpoints, full state dicts and the global gradient norm see the whole experts
   through DTensor, so nothing else needs to know about EP.
2. The layer's dispatcher becomes an `AllToAllDispatcher`: the per-expert counts of token copies are
   exchanged first (`all_to_all_single` on the counts), then the token copies (already sorted by expert)
   go to their owners with `all_to_all_single_autograd` (uneven and zero splits), are regrouped by local
   expert, computed, put back in arrival order and returned by the reverse all-to-all. Autograd runs
   through both directions.
3. The experts module is handed over to the data-parallel strategy (`strategy.add_experts`), which decides how
   it is sharded over the `ep_shard` mesh when it wraps the model (fsdp2: `distributed/fsdp2.py`'s `apply_fsdp`,
   with `moe.reshard_after_forward` and `moe.wrap_outer_model`); routers, attention, norms and shared experts
   are the strategy's dense units. A strategy that cannot shard experts says so in one line.
4. Gradient scale: the owner of an expert receives the token copies of all ep ranks, so its local weight
   gradient is the SUM over the ep group of the per-rank losses' gradients, and FSDP over ep_shard then
   AVERAGES over ep_shard. The single-process gradient is the mean over all dp*cp ranks, so the expert
   weights' gradient is multiplied by 1/ep in backward (`GroupedExperts.grad_scale`):
   (1/ep) * (1/ep_shard) * sum over dp*cp ranks = the mean. Parity tests prove it (EP2, EP4, EP2 x ep_shard 2).
5. `moe.ignore_router_for_ac` with activation checkpointing on: each router keeps its top-k decision of the
   forward and the recompute reuses it (`Router.replay_routing`), so routing is identical in the recompute.

Experts that receive no token still get a (zero) gradient on every rank: every local expert runs, also on
zero rows, so optimizers and clipping stay consistent across ranks.

Context parallelism (`share_moe_batch_stats`, called by parallelize after apply_cp): each micro batch's
tokens are split over the cp ranks, so the load-balancing loss's per-expert sums are added over the cp
group (exact single-process value) and its gradient scaled by cp (the dp_cp averaging divides it).

Auxiliary-loss-free balancing (`update_router_biases`, called by the runtime after each optimizer step): every MoE
layer whose router updates its selection bias (`model.router_bias_update_rate`) counted the token copies it sent
to each expert during the step; those loads are summed over the ranks that saw different tokens (dp x cp, which
holds the ep ranks; tp ranks see the same tokens) with ONE all-reduce of all layers' loads, on the device, and each
router moves its bias from the global load (models/moe.py `Router.update_bias`). Nothing reads a tensor back to
the host, and every rank applies the same update to its replica of the bias.

`AllToAllDispatcher.stats` counts what moved (rows and bytes per direction, tokens per local expert) for
`benchmarks/moe_dispatch.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshforge.errors import ConfigError
from meshforge.models import contract_of


class AllToAllDispatcher:
    """Sends token copies (sorted by global expert id) to the ranks owning those experts and back."""

    def __init__(self, group, ep_size: int, n_experts: int):
        if n_experts % ep_size:
            raise ValueError(f"model.n_experts={n_experts} is not divisible by distributed.ep_size={ep_size}")
        self.group, self.ep, self.n_experts = group, ep_size, n_experts
        self.local_experts = n_experts // ep_size
        self.my_ep_rank = dist.get_rank(group)
        self.stats: dict = {}
        self.reset_stats()

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module,
                 counts_list: list[int] | None = None) -> torch.Tensor:
        """`counts_list`: this rank's counts when the host knows them (balanced routing, where every rank routes
        alike, so what arrives is known too); the counts are exchanged either way."""
        ep, el = self.ep, self.local_experts
        send_counts = counts.to(torch.long)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [src, local expert] after view
        if counts_list is None:
            in_splits = send_counts.view(ep, el).sum(1).tolist()
            rc = recv_counts.view(ep, el)
            rc_list = rc.tolist()
        else:
            in_splits = [sum(counts_list[j * el:(j + 1) * el]) for j in range(ep)]
            rc_list = [counts_list[self.my_ep_rank * el:(self.my_ep_rank + 1) * el]] * ep
            rc = torch.tensor(rc_list, device=xs.device)
        out_splits = [sum(row) for row in rc_list]
        xr = all_to_all_single_autograd(xs.contiguous(), out_splits, in_splits, self.group)
        # arrivals are ordered (source rank, local expert): regroup by local expert, sources in rank order
        local_id = torch.arange(el, device=xs.device).repeat(ep)
        perm = torch.argsort(torch.repeat_interleave(local_id, rc.flatten().to(xs.device), output_size=sum(out_splits)),
                             stable=True)
        local_list = [sum(row[e] for row in rc_list) for e in range(el)]
        local_counts = torch.tensor(local_list, device=xs.device)
        y_local = _outside_selective_ac(experts, xr[perm], local_counts, local_list)
        y_arrival = y_local[torch.argsort(perm)]
        ys = all_to_all_single_autograd(y_arrival.contiguous(), in_splits, out_splits, self.group)
        self._count(xs, xr, ys, in_splits, out_splits, local_list)
        return ys

    # ------------------------------------------------------------------ accounting (benchmarks/moe_dispatch.py)
    def _add(self, phase: str, splits: list[int], width: int, elt: int) -> None:
        """One all-to-all that sends splits[j] rows of `width` elements to ep rank j."""
        rows = int(sum(splits))
        self.stats[f"{phase}_bytes"] += rows * width * elt
        self.stats[f"{phase}_bytes_remote"] += (rows - splits[self.my_ep_rank]) * width * elt

    def _count(self, xs, xr, ys, in_splits, out_splits, local_counts) -> None:
        d, elt = xs.shape[-1], xs.element_size()
        if torch._C._current_graph_task_id() != -1:  # an activation-checkpointing recompute inside backward
            self._add("recompute", in_splits, d, elt)
            self._add("recompute", out_splits, ys.shape[-1], ys.element_size())
            return
        s = self.stats
        s["calls"] += 1
        s["rows_sent"] += int(sum(in_splits))
        s["tokens_per_local_expert"] = [a + b for a, b in zip(s["tokens_per_local_expert"], local_counts)]
        self._add("forward", in_splits, d, elt)  # dispatch: my token copies to their experts' ranks
        self._add("forward", out_splits, ys.shape[-1], ys.element_size())  # combine: results back to senders
        if torch.is_grad_enabled() and ys.requires_grad:
            # backward: grad of ys goes back along the dispatch direction, grad of xr along the combine one
            ys.register_hook(lambda g: self._add("backward", in_splits, g.shape[-1], g.element_size()))
            xr.register_hook(lambda g: self._add("backward", out_splits, g.shape[-1], g.element_size()))

    def reset_stats(self) -> None:
        self.stats.clear()
        self.stats.update({"calls": 0, "rows_sent": 0,
                           "tokens_per_local_expert": [0] * self.local_experts})
        for phase in ("forward", "backward", "recompute"):
            self.stats[f"{phase}_bytes"] = self.stats[f"{phase}_bytes_remote"] = 0


def _outside_selective_ac(fn, *args):
    """Run `fn` (the FSDP-managed experts) outside selective activation checkpointing's op cache.

    Selective AC replays the region's ops by position and insists the recompute issue the same ops as the
    forward. The experts' FSDP hooks do not: in the recompute their state is IDLE rather than FORWARD, so
    they issue an extra `record_function` (FSDP::root_pre_forward) and the replay fails. Outside the cache
    the experts are simply recomputed (their saved tensors still come back through the checkpoint), which
    is correct for any policy; full AC has no cache and is unaffected. Only the cache's modes are set aside: any
    other mode (a memory tracker, a collective counter: the scale trace's, the bench's) still sees the experts.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    def caching(m) -> bool:
        return isinstance(m, (_CachingTorchDispatchMode, _CachedTorchDispatchMode))

    if not any(caching(m) for m in _get_current_dispatch_mode_stack()):
        return fn(*args)
    popped = []  # from the top of the stack down to the last caching mode, top first
    while any(caching(m) for m in _get_current_dispatch_mode_stack()):
        popped.append(_pop_mode())
    kept = [m for m in reversed(popped) if not caching(m)]
    for m in kept:
        _push_mode(m)
    try:
        return fn(*args)
    finally:
        for _ in kept:
            _pop_mode()
        for m in reversed(popped):
            _push_mode(m)


def apply_ep(model: nn.Module, mesh_ctx, dcfg, strategy, required: bool = True) -> nn.Module:
    """Split every MoE layer's experts over `ep` and hand them over to the strategy; see the module docstring.
    `required=False` (a pipeline stage): a model without MoE layers is left as it is."""
    contract = contract_of(model)
    layers = contract.moe_layers()
    if not layers and not required:
        return model
    if not layers:
        raise ConfigError(f"distributed.ep_size={mesh_ctx.ep_size} but the model ({type(model).__name__}) has no "
                          "MoE layers: use an MoE preset (e.g. tiny_moe) or set ep_size 1")
    ep_mesh = mesh_ctx.mesh("ep")
    ep = ep_mesh.size()
    moe_cfg = dcfg.moe_or_default
    replay = bool(moe_cfg.ignore_router_for_ac) and dcfg.ac_mode is not None
    for layer in layers:
        experts = layer.experts
        for name, p in list(experts.named_parameters()):  # per-expert adapters below it too: all stacked on dim 0
            if isinstance(p, DTensor):
                raise TypeError(f"expert parameter {name} is already a DTensor: apply_ep runs once, before "
                                 "any data-parallel wrapping")
            dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            owner, _, attr = name.rpartition(".")
            (experts.get_submodule(owner) if owner else experts).register_parameter(
                attr, nn.Parameter(dt, requires_grad=p.requires_grad))
        experts.grad_scale = 1.0 / ep
        layer.dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep, layer.n_experts)
        layer.router.replay_routing = replay
        strategy.add_experts(experts)
    return model

class _SumOverGroup:
    """Sums a small statistics tensor over a process group (no autograd; callers detach)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=self.group)
        return t


def share_moe_batch_stats(model: nn.Module, mesh_ctx) -> None:
    """Context parallelism splits each micro batch's tokens over the cp ranks; the MoE load-balancing loss is
    a statistic of the whole micro batch, so its per-expert sums are added over the cp group (the value is
    then the single-process one) and its gradient scaled by cp (see `MoE.load_balance_loss`). No-op for
    models without MoE layers or at cp_size 1."""
    if mesh_ctx.cp_size == 1:
        return
    for layer in contract_of(model).moe_layers():
        layer.stats_reducer = _SumOverGroup(mesh_ctx.group("cp"))
        layer.aux_grad_scale = float(mesh_ctx.cp_size)


def update_router_biases(parts: list[nn.Module], mesh_ctx) -> None:
    """Auxiliary-loss-free balancing at the step boundary (module docstring): one all-reduce over dp_cp of every
    balancing layer's load, then each layer's bias update. No-op for models without such layers."""
    layers = [(layer, load) for part in parts for layer in contract_of(part).moe_layers()
              if (load := layer.balance_load()) is not None]
    if not layers:
        return
    loads = torch.stack([load for _, load in layers])
    if mesh_ctx.world_size > 1 and mesh_ctx.size("dp_cp") > 1:
        dist.all_reduce(loads, group=mesh_ctx.group("dp_cp"))
    for (layer, _), load in zip(layers, loads, strict=True):
        layer.update_balance(load)


def dispatch_stats(model: nn.Module) -> list[dict]:
    """Per MoE layer, the dispatcher's counters (empty dicts for layers without EP)."""
    return [getattr(layer.dispatcher, "stats", {}) for layer in contract_of(model).moe_layers()]
