"""Peak memory of a traced step by category: torch's `MemTracker`, run for a whole training step.

`MemTracker` follows every storage an op creates (weak references, so a freed storage leaves the count when it
dies), categorises it (parameter, buffer, gradient, activation, temporary of backward, optimizer state) and keeps
the peak of the sum. Two of its habits do not fit a training step, so `StepMemory` turns them off:
- it refuses a module called twice in one tracked region (its per-module snapshots assume one call per
  iteration), but micro batches and pipeline schedules call every module many times;
- it walks every module's statistics on every op to keep per-module peaks (O(modules) per op: 3.4x the step's
  time at 8 blocks, measured), which nothing here reads.
What stays is MemTracker's own accounting: storages and their categories, parameters and gradients registered
when a module first runs (gradient hooks), optimizer states around `optimizer.step`, activation checkpointing's
recompute counted as activations, `UntypedStorage.resize_` (FSDP2 and megatron_fsdp free and regrow buffers so).
Sizes are the tensors' bytes (on CPU MemTracker does not round to the CUDA allocator's 512-byte blocks).

One more trap, measured (torch 2.13): DTensor computes an op's output metadata by running the op on global-shape
fake tensors (`ShardingPropagator._propagate_tensor_meta_non_cached`), under the active fake mode when there is
one. MemTracker skips those ops only when its fake mode at entry differs from theirs, which under the trace's
fake mode it does not: it counted the full-vocabulary logits gradient that loss_parallel's metadata propagation
creates (8.4 GB at TP 8, Llama 3 8B shapes) as memory. `StepMemory` marks that propagation and passes its ops
through untracked.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.weak import WeakIdKeyDictionary

TOTAL = "Total"
_DEVICE = torch.ops.prim.device.default
# MemTracker's reference types as the report names them
CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Other": "other"}


class StepMemory(MemTracker):
    """MemTracker for a whole step (see the module docstring); `peak()` is {category: bytes} at the peak. Hands
    every op to `comm` (a `CommRecorder`) too, and lets `.device` queries (a third of the ops a step dispatches
    under a Python mode) through untracked: they allocate nothing."""

    def __init__(self, comm=None) -> None:
        super().__init__()
        self.comm = comm
        self._seen = WeakIdKeyDictionary()
        self.peak_at = ""  # where the peak was: the phase, forward/backward and the innermost module running
        self.phase = "step"  # set by the tracer (micro batch i, after the last)
        self._propagating = 0  # inside DTensor's metadata propagation (see the module docstring)
        self._restore = None

    def _pre_fw_hook(self, module, inputs) -> None:
        if module not in self._seen:  # parameters, buffers and gradient hooks, as MemTracker registers them
            self._seen[module] = True
            # MemTracker hooks every parameter of the module (and its children), which fails on a frozen one
            # (LoRA's base weights): a module holding any gets none; its trainable children get theirs when they run
            hooks = all(p.requires_grad for p in module.parameters())
            self._track_module_params_and_buffers(module, install_grad_hooks=hooks)
        if self._mod_tracker.is_bw and self._ac_mod is None:  # a checkpointed module recomputed in backward
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[TOTAL]:
                self._peak_mem[dev] = snap[TOTAL]
                self._peak_mem_snap[dev] = dict(snap)
                self.peak_at = f"{self.phase}, " + ("backward " if self._mod_tracker.is_bw else "forward ") + \
                    max(self._mod_tracker.parents, key=len)

    def __enter__(self) -> StepMemory:
        prop = _sharding_propagator()
        if prop is not None and self._depth == 0:
            original = prop._propagate_tensor_meta_non_cached

            def propagate(*args, **kwargs):
                self._propagating += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self._propagating -= 1

            self._restore = (prop, original)
            prop._propagate_tensor_meta_non_cached = propagate
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0 and self._restore is not None:
            prop, original = self._restore
            del prop._propagate_tensor_meta_non_cached  # the class's method again
            self._restore = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE or self._propagating:
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.comm is not None and out is not NotImplemented:
            self.comm.record(func, args, kwargs or {})
        return out

    def peak(self) -> dict[str, int]:
        """{category: bytes} at the peak (all devices together; a traced rank has one) and `total`."""
        out = dict.fromkeys(CATEGORIES.values(), 0) | {"total": 0}
        for snap in self._peak_mem_snap.values():
            for key, n in snap.items():
                name = "total" if key == TOTAL else CATEGORIES.get(getattr(key, "value", str(key)), "other")
                out[name] += int(n)
        return out

    def current(self) -> int:
        return int(sum(snap[TOTAL] for snap in self._curr_mem_snap.values()))


def _sharding_propagator():
    """DTensor's sharding propagator (the object whose metadata propagation is marked), None if it moved."""
    try:
        from torch.distributed.tensor import DTensor

        prop = DTensor._op_dispatcher.sharding_propagator
    except AttributeError:
        return None
    return prop if hasattr(prop, "_propagate_tensor_meta_non_cached") else None
