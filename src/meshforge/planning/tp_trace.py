"""A tensor-parallel plan checked by running the model once as one tp rank would, in one process.

`planning/tp_plan.py` checks a plan against module shapes; what it cannot see is how the model uses the tensors in
between: a parameter the plan leaves whole (replicated) that meets a tensor-parallel-sharded activation. Such a
parameter either has a per-head shape and fails with a shape error in the first forward (Cohere's q/k LayerNorm,
weight (heads, head_dim), after column-wise q/k projections), or broadcasts and gets only this rank's share of its
gradient (a (head_dim,) q/k norm applied per head on this rank's heads), which would train silently wrong.

`trace_plan` finds both before anything is launched: it swaps every sharded module's weight for the slice tp rank 0
holds, runs one forward on a short sequence (CPU, real values; the RNG state is restored) and follows, op by op
(a `TorchDispatchMode`), which tensors are sharded activations: the outputs of column-wise modules and everything
computed from them, until a row-wise module reduces them. A replicated parameter (or a tensor computed from
parameters only) entering an op together with a sharded activation is reported, naming the parameter; a shape
error is reported naming the module it happened in. Never a shape error after launch.

One case has a clear rule and is made to work instead: a module outside the plan whose parameters all lead with a
dimension divisible by tp_size, used on sharded activations, is tried as `local_heads` (its parameters split on
dim 0 with the heads the column-wise projections give each rank, its forward on the local shards); if the model
then runs without a problem the style is added to the plan (Cohere's per-head q/k norms).

The model's forward must take token ids (the model contract's forward); the trace needs values (transformers'
models decide on them while masking), so it runs on a model in CPU memory, never on the meta device.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TRACED_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_output", "replicate", "local_heads")


def _slices(style: str, mod: Any, tp: int) -> list[tuple[Any, str, Any]]:
    """(module, parameter name, tp rank 0's slice) of a module the plan shards, LoRA factors as their base layer's
    style splits them (distributed/tensor_parallel.py); vocabulary layers keep their shapes (their sharded
    dimension never meets another tensor)."""
    from meshforge.models.lora import LoRALinear

    out = []
    for name, p in mod.named_parameters(recurse=False):
        if style in ("colwise", "local_heads"):
            out.append((mod, name, p[: p.shape[0] // tp]))
        elif style == "rowwise" and name == "weight":
            out.append((mod, name, p[:, : p.shape[1] // tp]))
    if isinstance(mod, LoRALinear) and style in ("colwise", "rowwise"):
        factor = mod.lora_B if style == "colwise" else mod.lora_A
        w = factor.weight
        out.append((factor, "weight", w[: w.shape[0] // tp] if style == "colwise" else w[:, : w.shape[1] // tp]))
    return out


class _Taint:
    """A TorchDispatchMode following sharded activations and replicated parameters through the aten ops."""

    def __init__(self, replicated: dict[int, str]):
        from torch.utils._python_dispatch import TorchDispatchMode

        taint = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return taint.op(func, args, kwargs or {})

        self.mode = Mode()
        self.sharded: dict[int, Any] = {}  # id -> tensor (kept alive so ids are not reused)
        self.params: dict[int, frozenset[str]] = {k: frozenset([v]) for k, v in replicated.items()}
        self.keep: list[Any] = []
        self.partial: dict[str, str] = {}  # parameter -> the op that met a sharded activation

    def mark(self, out: Any, sharded: bool) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if sharded:
                    self.sharded[id(t)] = t
                else:
                    self.sharded.pop(id(t), None)

    def is_sharded(self, x: Any) -> bool:
        import torch
        from torch.utils._pytree import tree_leaves

        return any(id(t) in self.sharded for t in tree_leaves(x) if isinstance(t, torch.Tensor))

    def op(self, func, args, kwargs):
        import torch
        from torch.utils._pytree import tree_leaves

        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sharded = any(id(t) in self.sharded for t in inputs)
        params = frozenset().union(*(self.params.get(id(t), frozenset()) for t in inputs))
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if sharded and params and any(t.is_floating_point() for t in outs):
            for name in sorted(params):
                self.partial.setdefault(name, str(func))
        if sharded:
            self.mark(out, True)
        elif params and all(id(t) in self.params for t in inputs):  # computed from parameters only
            for t in outs:
                self.params[id(t)] = params
                self.keep.append(t)
        return out


@contextmanager
def _swapped(modules: dict[str, Any], plan: dict[str, str], tp: int) -> Iterator[None]:
    saved = []
    try:
        for name, style in plan.items():
            for mod, pname, local in _slices(style, modules[name], tp):
                saved.append((mod, pname, mod._parameters[pname]))
                mod._parameters[pname] = local
        yield
    finally:
        for mod, pname, p in reversed(saved):
            mod._parameters[pname] = p


def _run(model: Any, plan: dict[str, str], tp: int, seq_len: int, vocab: int) -> tuple[dict[str, str], str | None,
                                                                                      str | None]:
    """One traced forward: ({parameter: op} met sharded activations, module of a shape error, its message)."""
    import torch

    modules = dict(model.named_modules())
    covered = {id(p) for name in plan for p in modules[name].parameters()}
    replicated = {id(p): n for n, p in model.named_parameters() if id(p) not in covered and p.requires_grad}
    taint = _Taint(replicated)
    stack: list[str] = []
    handles = []

    def pre(name, style):
        def hook(mod, args):
            stack.append(name)
            if style == "rowwise" and not taint.is_sharded(args):
                raise _PlanError(name, "row-wise but its input is whole (no column-wise module before it)")
            if style in ("colwise", "vocab_output") and taint.is_sharded(args):
                raise _PlanError(name, f"{style} but its input is already sharded (a column-wise module before it "
                                       "without a row-wise one in between)")
        return hook

    def post(style):
        def hook(mod, args, out):
            stack.pop()
            if style in ("colwise", "rowwise", "vocab_embedding"):
                taint.mark(out, style == "colwise")
        return hook

    for name, mod in modules.items():
        style = plan.get(name)
        handles.append(mod.register_forward_pre_hook(pre(name, style)))
        handles.append(mod.register_forward_hook(post(style)))
    tokens = (torch.arange(seq_len) % vocab).unsqueeze(0)
    was_training = model.training
    try:
        with torch.random.fork_rng(devices=[]), _swapped(modules, plan, tp), taint.mode:
            model.train()
            model(tokens)
    except _PlanError as err:
        return taint.partial, err.module, err.why
    except Exception as err:  # the forward itself failed on the shards: a shape error, named by its module
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return taint.partial, stack[-1] if stack else "", text
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return taint.partial, None, None


class _PlanError(Exception):
    def __init__(self, module: str, why: str):
        super().__init__(why)
        self.module, self.why = module, why


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def trace_plan(model: Any, resolved: dict[str, str], tp: int, seq_len: int = 16, vocab: int = 2
               ) -> tuple[dict[str, str], list[str]]:
    """({module: "local_heads"} the plan needs added, problems) for `resolved` ({module: style}) at tp_size `tp`.
    A plan with styles the trace does not model (sequence parallelism) is not traced: ({}, [])."""
    if any(s not in TRACED_STYLES for s in resolved.values()):
        return {}, []
    plan = {n: s for n, s in resolved.items() if s != "replicate"}
    modules = dict(model.named_modules())
    added: dict[str, str] = {}
    tried: set[str] = set()
    partial, failed_in, why = _run(model, plan, tp, seq_len, vocab)
    while True:
        suspects = [failed_in] if failed_in and failed_in not in plan else []
        suspects += [p.rpartition(".")[0] for p in partial]
        fix = next((s for s in suspects if _pattern(s) not in tried and _heads_like(modules.get(s), tp)), None)
        if fix is None:
            break
        pattern = _pattern(fix)
        tried.add(pattern)
        candidate = {**added, **{n: "local_heads" for n in modules if n and _pattern(n) == pattern
                                 and _heads_like(modules[n], tp)}}
        again = _run(model, {**plan, **candidate}, tp, seq_len, vocab)
        in_fixed = (again[1] is not None and _pattern(again[1]) == pattern) or \
            any(_pattern(p.rpartition(".")[0]) == pattern for p in again[0])
        if not in_fixed:  # it runs there now: keep it (what remains elsewhere is the next suspect)
            added, (partial, failed_in, why) = candidate, again
    problems = []
    if failed_in is not None:
        problems.append(f"tensor parallelism: with distributed.tp_size={tp} the model fails in module "
                        f"{failed_in!r} ({why}), which the plan leaves as it is: give that module a style in "
                        "distributed.tp_plan or set tp_size 1")
    for param, op in sorted(partial.items()):
        problems.append(f"tensor parallelism: parameter {param!r} is kept whole on every tp rank but is used with "
                        f"activations the plan splits over distributed.tp_size={tp} (in {op}), so each rank would "
                        "get only its share of its gradient: give its module a style in distributed.tp_plan or set "
                        "tp_size 1")
    return added, fold_repeats(problems)


def fold_repeats(problems: list[str]) -> list[str]:
    """The same problem in many layers is one line: '<container>.*.x' (in N layers)."""
    groups: dict[str, list[str]] = {}
    for msg in problems:
        groups.setdefault(re.sub(r"'([\w.]*?)\.\d+\.", r"'\1.*.", msg), []).append(msg)
    return [msgs[0] if len(msgs) == 1 else f"{key} (in {len(msgs)} layers)" for key, msgs in groups.items()]


def _heads_like(mod: Any, tp: int) -> bool:
    """Parameters that can be split with the heads: every one leads with a dimension divisible by tp_size."""
    params = list(mod.parameters(recurse=False)) if mod is not None else []
    return bool(params) and all(p.dim() >= 1 and p.shape[0] % tp == 0 and p.shape[0] >= tp for p in params)
