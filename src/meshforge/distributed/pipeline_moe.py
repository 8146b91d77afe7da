"""Mixture-of-experts layers in pipeline stages: what the schedule must carry besides the hidden states.

- The aux (load-balancing) loss: a stage that is not the last attaches its MoE layers' aux loss to its output
  (`AuxLossGrad`, Megatron's MoEAuxLossAutoScaler) with the weight the loss gives it (`aux_loss_weight`), so it is
  counted once per microbatch, as without PP, and reaches the routers through the schedule's own backward of that
  microbatch; the last stage's aux loss goes through the loss function. Router statistics stay with the layers
  of each stage.
- A forward whose backward never runs (torch's metadata inference): `Stage` drops what it left in the MoE layers
  before each step's first microbatch, the routing decisions kept for replay (`moe.ignore_router_for_ac`) and the
  load it added to auxiliary-loss-free balancing's count.
Nothing here names a model's modules: the MoE layers come from the model contract (`moe_layers()`), and a stage's
forward returns (hidden states, aux loss) in training when it has any (the contract of an MoE model).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage


def aux_loss_weight(plan, scale_in_schedule: bool) -> float:
    """The weight of a microbatch's auxiliary (MoE load-balancing) loss in what the stages backpropagate: 1/n as
    without PP (a per-microbatch mean over the step's n microbatches), or 1 when the schedule divides every
    gradient by n itself (`scale_grads_in_schedule`)."""
    return 1.0 if scale_in_schedule else 1.0 / plan.n_microbatches


class AuxLossGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also gives the stage's auxiliary loss the gradient `coeff`, the
    weight the loss gives it (Megatron's MoEAuxLossAutoScaler): the aux loss of the stage's MoE layers reaches
    their routers once per microbatch, through the schedule's own backward of that microbatch, and nothing but the
    hidden states travels between stages."""

    @staticmethod
    def forward(ctx, out, aux, coeff: float):
        ctx.coeff, ctx.aux_shape, ctx.aux_dtype = coeff, aux.shape, aux.dtype
        # a copy, not a view: zero-bubble schedules detach a stage's outputs in place, which a view refuses (the
        # input is not kept by anything, so this is a transient second copy of one activation)
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.coeff, dtype=ctx.aux_dtype, device=grad.device), None


def carry_aux_loss(module: nn.Module, coeff: float) -> None:
    """A stage that is not the last returns its hidden states, or (hidden states, aux loss) in training (the model
    contract): the aux loss is attached to the hidden states (`AuxLossGrad`), so the stage sends one tensor.
    The last stage's aux loss goes through the loss function, as without PP."""

    def hook(mod, args, out):
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].dim() == 0:
            return AuxLossGrad.apply(out[0], out[1], coeff) if out[1].requires_grad else out[0]
        return out

    module.register_forward_hook(hook)


class Stage(PipelineStage):
    """torch's stage, dropping at each step's first microbatch what a forward without a backward left in its MoE
    layers (`MoE.forget_forward`: stored routing decisions, balancing load): torch 2.13's metadata inference runs a
    stage's forward with autograd on, and its backward only where the stage's input needs a gradient (not on the
    first stage), so the first real recompute would replay the inference's decision, and the first step's bias
    update would count its tokens. A step's forwards all come after the previous step's backwards and bias update,
    so nothing a real microbatch recorded is dropped."""

    def __init__(self, *args, moe_layers: list[nn.Module], **kwargs):
        super().__init__(*args, **kwargs)
        self._moe_layers = moe_layers

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if fwd_chunk_id == 0:
            for layer in self._moe_layers:
                layer.forget_forward()
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
