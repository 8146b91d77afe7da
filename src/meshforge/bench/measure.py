"""Exact accounting for the bench: bytes passed to collectives, bytes of state each rank holds, step timing.

Communication. Every collective, whoever issues it, reaches the dispatcher as a
`c10d::*` op (the eager API, including DDP's C++ reducer and FSDP2, which in torch
2.13 calls `dist.all_gather_single` / `dist.reduce_scatter_single`) or a
`_c10d_functional*::*` op (DTensor, functional collectives). `CommCounter` is a
TorchDispatchMode that records, for each such op, the size of the collective's full
buffer: the all-gathered output, the reduce-scattered input, the all-reduced or
broadcast tensor, the all-to-all input. (Patching Python entry points would miss
DDP's reducer, which calls the process group from C++, and breaks whenever torch
renames the functions FSDP2 uses.) A Python dispatch mode slows every op, so the
bench counts during one extra step run after the timed ones, with the same shapes
and code path, and never while timing. Ops on tensor subclasses are handed to the
subclass first, so the collectives DTensor issues inside its own dispatch (grad-norm
reductions, tensor-parallel redistribution) are counted too.

Memory. `state_bytes` counts the storages (deduplicated, so views into one flat
buffer or tied weights count once, and padding counts) behind this rank's
parameters, gradients and optimizer state: DTensors by their local shard,
optimizer-held parameters (e.g. fp32 main shards) included, and the gradient
buffers a strategy keeps beside `.grad` (`strategy.grad_buffer_bytes`, e.g. DDP's
reducer buckets) counted as gradient memory. A strategy with its own flat buffers
returns `memory_report(optimizer)` with `params_at_rest`, `grads` and
`optimizer_state` (the base strategy returns None), which is then used, the
storage count kept beside it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshforge.distributed.master_weights import master_tensors

_NAMESPACES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
_FREE = {"barrier", "monitored_barrier_", "check_for_nan", "wait_tensor", "_wrap_tensor_autograd"}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def collective_bytes(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes of the full buffer one collective moves (per rank), from its op name and arguments."""
    ns, op = name.split("::", 1)
    a = list(args) + list(kwargs.values())
    if op in _FREE:
        return 0
    if ns == "c10d":
        if op in ("_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"):
            return _nbytes(a[0])  # the gathered output
        if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_",
                  "alltoall_", "gather_"):
            return _nbytes(a[1])  # the full input
        return _nbytes(a[0])  # allreduce_, allreduce_coalesced_, broadcast_, reduce_, scatter_, send, recv_
    # functional collectives return new tensors: input (x group size for gathers)
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return _nbytes(a[0]) * int(a[1])
    if op == "all_gather_into_tensor_out":
        return _nbytes(kwargs.get("out", a[-1]))
    return _nbytes(a[0])


class CommCounter(TorchDispatchMode):
    """Counts calls and bytes per collective op while active (`with CommCounter() as c:`)."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in _PLAIN for t in types):
            # a tensor subclass (DTensor) first: it may run collectives inside its own dispatch (a Partial
            # norm becoming Replicate), which this mode sees only if the subclass handles the op under it
            return NotImplemented
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith(_NAMESPACES):
            n = collective_bytes(name, args, kwargs)
            if n or name.split("::", 1)[1] not in _FREE:
                self.bytes[name] += n
                self.calls[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def summary(self) -> dict:
        return {"total": self.total, "by_op": dict(self.bytes), "calls": dict(self.calls)}


# ------------------------------------------------------------------------------ memory
def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class _StorageSet:
    def __init__(self):
        self.seen: set = set()

    def add(self, t: torch.Tensor | None) -> int:
        """Bytes of t's storages not counted yet (0 for freed or already-counted storage); a wrapper subclass
        (torchao's float8 weights) by the storages it wraps."""
        from torch.distributed._tools.common_utils import get_untyped_storages

        if t is None:
            return 0
        total = 0
        for st in get_untyped_storages(_local(t)):
            n = st.nbytes()
            key = st._cdata  # the storage itself (fake tensors' storages all have data_ptr 0: the scale trace)
            if n and key not in self.seen:
                self.seen.add(key)
                total += n
        return total


def state_bytes(models: list, optimizer: torch.optim.Optimizer, strategy=None) -> dict:
    """Bytes this rank holds in params, grads and optimizer state (call after step, before zero_grad)."""
    counted = _storage_count(models, optimizer, strategy)
    rep = strategy.memory_report(optimizer) if strategy is not None else None
    if rep is None:
        return counted
    out = {"params": int(rep["params_at_rest"]), "grads": int(rep["grads"]), "optimizer": int(rep["optimizer_state"])}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return {"source": "strategy.memory_report", **out, "storages_total": counted["total"],
            "report": {k: v for k, v in rep.items() if isinstance(v, (int, float))}}


def _storage_count(models: list, optimizer: torch.optim.Optimizer, strategy=None) -> dict:
    seen = _StorageSet()
    params = [p for m in models for p in m.parameters()]
    params += [p for g in optimizer.param_groups for p in g["params"]]
    out = {"params": sum(seen.add(p) for p in params)}
    out["grads"] = sum(seen.add(p.grad) for p in params)
    if strategy is not None:  # gradient buffers the strategy keeps beside `.grad` (DDP's reducer buckets)
        out["grads"] += sum(strategy.grad_buffer_bytes(m) for m in models)
    out["grads"] += sum(seen.add(getattr(p, "main_grad", None)) for p in params)  # bf16_params: fp32 grads
    out["optimizer"] = sum(seen.add(t) for st in optimizer.state.values() for t in st.values()
                           if isinstance(t, torch.Tensor))
    out["optimizer"] += sum(seen.add(t) for t in master_tensors(optimizer))  # bf16_params: fp32 masters
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return {"source": "storages", **out}


# ------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def step_stats(times_s: list[float]) -> dict:
    med = statistics.median(times_s)
    p10, p90 = percentile(times_s, 0.1), percentile(times_s, 0.9)
    return {"step_s_median": med, "step_s_p10": p10, "step_s_p90": p90, "step_s_min": min(times_s),
            "step_s_max": max(times_s), "spread_pct": 100.0 * (p90 - p10) / med if med else 0.0,
            "step_s_all": list(times_s)}


def throughput_fields(step_s: float, tokens_per_step: int, world_size: int, flops_per_token: float,
                      peak_tflops: float | None) -> dict:
    tps_dev = tokens_per_step / step_s / world_size
    tflops = tps_dev * flops_per_token / 1e12
    return {"tokens_per_s": tps_dev * world_size, "tokens_per_s_per_device": tps_dev,
            "tflops_per_device": tflops, "mfu": tflops / peak_tflops if peak_tflops else None,
            "peak_tflops": peak_tflops}
