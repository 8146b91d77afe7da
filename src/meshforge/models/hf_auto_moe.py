"""Mixture-of-experts layers of a `model.hf_model` (models/hf_auto.py): the router's auxiliary loss and expert
parallelism over transformers' own fused experts.

transformers 5 keeps each MoE layer's routed experts in one module with stacked parameters (dim 0 = expert, e.g.
`Qwen3MoeExperts.gate_up_proj` (E, 2 x moe_ffn, dim)) and one interface, `forward(hidden (T, dim), top_k_index
(T, k), top_k_weights (T, k)) -> (T, dim)` = sum over k of weight x expert(hidden), whatever kernel computes it
(`use_experts_implementation` marks these classes: they carry `_is_expert_parallel`). The router is a separate
module the layer calls first; meshforge leaves it alone.

Expert parallelism (`distributed/expert_parallel.py` applies it to `moe_layers()`): the experts' stacked parameters
are sharded on dim 0 over the `ep` mesh and, once `HFMoELayer.dispatcher` is set, the experts module's forward
sorts the token copies by expert, sends them to the ranks owning those experts with the dispatcher's all-to-all,
runs transformers' own experts forward on the local experts only (each row routed to its local expert with weight
1, the parameters swapped for their local shards, `num_experts` for the local count), brings the rows back and
applies the routing weights, as `models/moe.py` does for the built-in MoE. The local parameters' gradient is
scaled by `grad_scale` (1/ep, see expert_parallel.py) and every local parameter gets a gradient each step (zero
when no token arrived), so every rank reduces the same tensors. An experts module without that interface, or one
holding a parameter that is not stacked by expert, cannot be sharded: expert parallelism is refused (`ep_problem`).

The auxiliary (load-balancing) loss: with `output_router_logits: true` transformers' causal-LM class computes it
from the router logits of the micro batch and, given labels, adds `router_aux_loss_coef` (JetMoE:
`aux_loss_coef`) times it to the loss. meshforge computes the cross-entropy itself, so the forward returns
(logits, coefficient x aux_loss), which `models.loss.lm_loss` adds exactly as transformers would.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from meshforge.models.moe import _ScaleGrad

# the attribute a transformers causal-LM class reads the aux-loss coefficient from (when it adds it to the loss)
AUX_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def experts_modules(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed-experts module with transformers' experts interface, in model order."""
    return [(n, m) for n, m in hf.named_modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


def ep_problem(hf: nn.Module) -> str | None:
    """Why expert parallelism cannot shard this model's experts (None: it can)."""
    found = experts_modules(hf)
    if not found:
        named = sorted({type(m).__name__ for m in hf.modules() if "Expert" in type(m).__name__})
        what = f"its experts ({', '.join(named)}) do not take" if named else "it has no experts module with"
        return (f"{what} transformers' fused experts interface (stacked expert parameters, forward(hidden, "
                "top_k_index, top_k_weights)), which expert parallelism shards")
    for name, m in found:
        for pname, p in m.named_parameters():
            if "." in pname or p.dim() == 0 or p.shape[0] != m.num_experts:
                return (f"{name}.{pname} ({type(m).__name__}) has shape {list(p.shape)}, not stacked by expert "
                        f"(dim 0 = num_experts = {m.num_experts}), so the experts cannot be split by expert")
    return None


def aux_loss_coefficient(hf: nn.Module) -> float | None:
    """The coefficient transformers' causal-LM class multiplies its auxiliary loss by, or None when it has none."""
    for owner in (hf, hf.config):
        for attr in AUX_COEFFICIENTS:
            value = getattr(owner, attr, None)
            if isinstance(value, (int, float)):
                return float(value)
    return None


class _RouterFlags:
    """What expert parallelism sets on a layer's router. `replay_routing` needs no action here: the activation-
    checkpointing recompute runs transformers' router again with the same ops on the same inputs and device, so it
    routes every token as the forward did."""

    replay_routing = False


class HFMoELayer:
    """One transformers MoE layer as `distributed/expert_parallel.py` sees it: `experts` (the module it shards and
    hands to the strategy), `n_experts`, `router`, `dispatcher` (set: tokens go through it) and `balance_load`."""

    def __init__(self, experts: nn.Module):
        self.experts = experts
        self.n_experts = int(experts.num_experts)
        self.router = _RouterFlags()
        self.stats_reducer, self.aux_grad_scale = None, 1.0  # context parallelism (refused with hf_model)
        self._dispatcher = None

    @property
    def dispatcher(self):
        return self._dispatcher

    @dispatcher.setter
    def dispatcher(self, value) -> None:
        self._dispatcher = value
        # an instance forward: module hooks (FSDP's gather of the expert shards) still run around it
        if value is None:
            self.experts.__dict__.pop("forward", None)
        else:
            self.experts.forward = functools.partial(_dispatched_forward, self)

    def balance_load(self) -> None:
        """Auxiliary-loss-free balancing is meshforge's router option; transformers' routers have no updated bias."""
        return None


def _dispatched_forward(layer: HFMoELayer, hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface, with the token copies sent to the experts' ranks and back."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    counts = torch.bincount(flat, minlength=layer.n_experts)
    order = torch.argsort(flat, stable=True)  # token copies grouped by expert, token order inside
    token = order // k
    ys = layer.dispatcher(hidden[token], counts, functools.partial(_local_experts, layer.experts))
    ys = ys * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
    out = torch.zeros(hidden.shape[0], ys.shape[-1], dtype=ys.dtype, device=ys.device).index_add(0, token, ys)
    return out.to(hidden.dtype)


def _local_experts(experts: nn.Module, x: torch.Tensor, local_counts: torch.Tensor,
                   counts_list: list[int] | None = None) -> torch.Tensor:
    """Rows grouped by local expert (`local_counts` rows each) through transformers' own experts forward.

    `counts_list` (the dispatcher's host copy of `local_counts`, part of the Experts signature) is not needed: the
    rows are exactly `x`'s, so the expert ids are built without a device-to-host sync either way."""
    n_local = local_counts.numel()
    ids = torch.repeat_interleave(torch.arange(n_local, device=x.device), local_counts.to(x.device),
                                  output_size=x.shape[0]).unsqueeze(-1)
    scale = getattr(experts, "grad_scale", 1.0)
    local = {}
    for name, p in experts.named_parameters(recurse=False):
        t = p.to_local() if hasattr(p, "to_local") else p
        local[name] = _ScaleGrad.apply(t, scale) if scale != 1.0 else t
    with _swapped(experts, local, n_local):
        y = type(experts).forward(experts, x, ids, torch.ones(ids.shape, dtype=x.dtype, device=x.device))
    # a zero term in every local parameter: each gets a gradient even when no token reached its experts
    return y + sum(t.reshape(-1)[:1].sum() for t in local.values()) * 0.0


@contextlib.contextmanager
def _swapped(experts: nn.Module, local: dict[str, torch.Tensor], n_local: int):
    saved, saved_n = {n: experts._parameters[n] for n in local}, experts.num_experts
    experts._parameters.update(local)
    experts.num_experts = n_local
    try:
        yield
    finally:
        experts._parameters.update(saved)
        experts.num_experts = saved_n
