"""AdamW over fp32 master weights for a model whose parameters are bf16 (`training.precision: bf16_params`).

Why: bf16 parameters run forward and backward in bf16 with no autocast (no per-op casts, no cast cache), but
an update smaller than half a bf16 ulp of the weight (lr 1e-4 on a weight near 1: ulp 2^-7) would round away.
So the optimizer keeps an fp32 copy of every trainable parameter next to its moments (`state[p]["master"]`),
steps that copy with the plain (fused on every device) AdamW kernel from the bf16 gradient upcast to fp32,
and rounds the result back into the bf16 parameter. The parameter is always `master.to(bf16)`.

The master lives in the optimizer's state, so everything that reads optimizer state sees it without being
told: a checkpoint saves it (resume is bitwise exact), the bench counts its bytes (4 per trainable parameter,
beside the 8 of the moments). `torch.optim.Optimizer.load_state_dict` casts every floating state tensor to
its parameter's dtype (it would turn the master and the moments into bf16); `load_state_dict` here puts the
saved fp32 values back after it.

Under fsdp2 with more than one data rank the strategy keeps the fp32 shards itself (its mixed-precision
policy gathers bf16), the parameters the optimizer sees are fp32, and the plain AdamW runs.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import torch

from meshforge.errors import CheckpointError

_MASTER = "master"


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose parameters are bf16 and whose update runs on fp32 masters kept in its state."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        saved_groups, saved_state = [g["params"] for g in self.param_groups], self.state
        pairs = []  # (bf16 parameter, fp32 master) of every parameter with a gradient
        swapped: defaultdict = defaultdict(dict)
        for group in self.param_groups:
            masters = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = saved_state[p]
                master = st.get(_MASTER)
                if master is None:  # first step: the moments are created by AdamW below, in this same dict
                    master = p.detach().to(torch.float32)
                master.grad = p.grad.to(torch.float32)
                swapped[master] = st
                masters.append(master)
                pairs.append((p, master))
            group["params"] = masters
        try:
            self.state = swapped
            super().step()
        finally:
            self.state = saved_state
            for group, params in zip(self.param_groups, saved_groups):
                group["params"] = params
        for p, master in pairs:
            saved_state[p][_MASTER] = master
            master.grad = None
            p.copy_(master)  # round to nearest: the bf16 parameter is the master's rounding
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the master and the moments stay fp32 (torch casts them to the bf16 parameter's dtype)."""
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        fp32 = {pid: {k: v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}
                for pid, st in state_dict["state"].items()}
        missing = [pid for pid, st in fp32.items() if st and _MASTER not in st]
        if missing:
            raise CheckpointError("the optimizer state holds no fp32 master weights (saved with "
                                  "training.precision other than bf16_params): resume with the precision it was "
                                  "saved with")
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):
            for key, value in fp32.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)


def needs_master_weights(param_groups: list[dict]) -> bool:
    """True when a trainable parameter is stored below fp32 (training.precision=bf16_params at world size 1)."""
    return any(p.dtype != torch.float32 and p.is_floating_point() for g in param_groups for p in g["params"])
