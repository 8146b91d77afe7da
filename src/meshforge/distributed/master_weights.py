"""AdamW over fp32 master weights for a model whose parameters are bf16 (`training.precision: bf16_params`).

Why: bf16 parameters run forward and backward in bf16 with no autocast (no per-op casts, no cast cache), but
an update smaller than half a bf16 ulp of the weight (lr 1e-4 on a weight near 1: ulp 2^-7) would round away.
So the optimizer keeps an fp32 copy of every trainable parameter (`masters`), steps it with the plain AdamW
kernel (fused on every device) from the fp32 gradient (`main_grad`, below), and rounds the result back into the
bf16 parameter: the parameter is always `master.to(bf16)`.

Where the masters go:
- checkpoints: they stand in for the bf16 parameters in the model's state dict (`master_state_dict`, through
  the checkpoint part `checkpoint/parts.py` `MasterWeights`), so a checkpoint holds the fp32 weights, a resume
  is bitwise exact, and it loads into any precision or layout (fsdp2's fp32 shards, an fp32 run) like any
  other checkpoint;
- the optimizer's state dict holds the fp32 moments only, as plain AdamW's (torch's `load_state_dict` casts
  floating state to the parameter's dtype: `load_state_dict` here puts the fp32 values back);
- the bench counts them with the optimizer state (`master_tensors`): 4 bytes per trainable parameter beside
  the 8 of the moments, with 2 for the bf16 parameter and 4 for its fp32 main gradient.

Full precision end to end (as Megatron's main_param / main_grad):
- the master is made when the model is cast (`cast_to_bf16_with_masters`): it is the parameter's fp32 storage
  itself, so weights loaded before the cast (an hf_model folder's own weights) are not rounded first, and
  weights loaded after it (`model.init_from`, `peft.init_from`) go through `write_param`, into the master;
- gradients accumulate in fp32: a post-accumulate-grad hook adds each micro-batch's bf16 gradient into the
  parameter's fp32 `main_grad` and frees the bf16 one, so many small micro-batch gradients are not rounded to
  bf16 at every addition; the grad norm and clipping read `main_grad` (grad_norm.py), and the master steps
  from it directly (no fp32 copy of the gradients at step time).

Under fsdp2 with more than one data rank the strategy keeps the fp32 shards itself (its mixed-precision policy
gathers bf16 and reduces in fp32; with gradient sync off between micro-batches it accumulates the unsharded
gradient in its reduce dtype, fp32), the parameters the optimizer sees are fp32, and plain AdamW runs.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import torch
from torch import nn


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose parameters are bf16 and whose update runs on fp32 masters (`masters`: parameter -> master)
    from fp32 gradients (`p.main_grad`, accumulated over the micro-batches by a hook on each parameter)."""

    masters: dict[torch.Tensor, torch.Tensor]

    def add_param_group(self, param_group: dict) -> None:
        """Every parameter gets its fp32 master when it joins (torch's __init__ adds the groups through here):
        the one made at the cast (`p.main_param`, full precision) or else its upcast."""
        super().add_param_group(param_group)
        masters = self.__dict__.setdefault("masters", {})
        for p in self.param_groups[-1]["params"]:
            main = getattr(p, "main_param", None)
            masters[p] = main if main is not None else p.detach().to(torch.float32, copy=True)
            p.main_param = masters[p]
            if p.requires_grad and not hasattr(p, "main_grad"):  # once per parameter, even if re-adopted
                p.main_grad = None
                p.register_post_accumulate_grad_hook(accumulate_main_grad)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        saved_params, saved_state = [g["params"] for g in self.param_groups], self.state
        pairs, swapped = [], defaultdict(dict)  # AdamW sees the masters, keyed to the parameters' state dicts
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                accumulate_main_grad(p)  # a gradient assigned to p.grad directly (no backward) counts too
                if p.main_grad is None:
                    continue
                master = self.masters[p]
                master.grad = p.main_grad
                swapped[master] = saved_state[p]
                masters.append(master)
                pairs.append((p, master))
            group["params"] = masters
        try:
            self.state = swapped
            super().step()
        finally:
            self.state = saved_state
            for group, params in zip(self.param_groups, saved_params):
                group["params"] = params
        for p, master in pairs:
            master.grad = None
            p.copy_(master)  # round to nearest: the bf16 parameter is the master's rounding
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.masters:
            if p.main_grad is not None:
                if set_to_none:
                    p.main_grad = None
                else:
                    p.main_grad.zero_()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments stay fp32 (torch casts them to the bf16 parameter's dtype)."""
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        fp32 = {pid: {k: v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}
                for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):
            for key, value in fp32.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def master_state_dict(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state dict with each bf16 parameter replaced by its fp32 master (what a checkpoint saves
        and loads into; loading that state dict into the model then rounds them into the parameters)."""
        by_ptr = {p.data_ptr(): m for p, m in self.masters.items() if p.numel()}
        return {k: by_ptr.get(v.data_ptr(), v) if v.numel() else v for k, v in model_state.items()}


@torch.no_grad()
def accumulate_main_grad(p: torch.Tensor) -> None:
    """Add p's bf16 gradient into its fp32 `main_grad` and free it (a post-accumulate-grad hook: runs once per
    micro-batch, after autograd has written p.grad, so the sum over micro-batches is taken in fp32)."""
    if p.grad is None:
        return
    if p.main_grad is None:
        p.main_grad = p.grad.to(torch.float32)
    else:
        p.main_grad.add_(p.grad)  # fp32 += bf16: computed in fp32
    p.grad = None


def cast_to_bf16_with_masters(model: nn.Module) -> None:
    """Cast the model to bf16 (training.precision=bf16_params, masters in the optimizer); each trainable
    parameter keeps its fp32 storage as `main_param`, the master the optimizer adopts, so the values it held
    (initialised or loaded in full precision) are not rounded before the masters exist. Frozen parameters (a
    LoRA base) are only cast: they take no update."""
    for p in model.parameters():
        if p.requires_grad and p.dtype == torch.float32:
            main = p.data
            p.data = main.to(torch.bfloat16)
            p.main_param = main
    model.to(torch.bfloat16)  # the buffers, and any parameter not cast above


def keep_masters(model: nn.Module, strategy, precision: str) -> None:
    """training.precision=bf16_params on a model (or pipeline stage) whose strategy does not keep the fp32 masters
    itself (`Strategy.holds_masters`): cast it to bf16, the masters then live in the optimizer."""
    if precision == "bf16_params" and not strategy.holds_masters:
        cast_to_bf16_with_masters(model)


@torch.no_grad()
def write_param(p: torch.Tensor, value: torch.Tensor) -> None:
    """Load a weight into a parameter: into its fp32 master where it has one (bf16_params), then the master's
    rounding into p; else cast to p's dtype. Loaders use this so no full-precision weight is rounded first."""
    main = getattr(p, "main_param", None)
    if main is not None:
        main.copy_(value.to(device=main.device, dtype=main.dtype))
        p.copy_(main)
    else:
        p.copy_(value.to(device=p.device, dtype=p.dtype))


def needs_master_weights(param_groups: list[dict]) -> bool:
    """True when a trainable parameter is stored below fp32 (training.precision=bf16_params at world size 1)."""
    return any(p.is_floating_point() and p.dtype != torch.float32 for g in param_groups for p in g["params"])


def master_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The fp32 master weights an optimizer holds outside its state (none for a plain optimizer)."""
    return list(optimizer.masters.values()) if isinstance(optimizer, MasterWeightAdamW) else []
