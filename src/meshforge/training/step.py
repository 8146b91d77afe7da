"""One training step's forward and backward over the micro batches of this rank.

`ParallelModel` is what the trainer holds: the model part(s) this rank runs, the
strategy that wraps them, and the forward/backward of one global batch. Pipeline
parallelism subclasses it (its schedule drives forward and backward); everything
else uses this class. Parallelisms that change how a batch is fed or how the loss
is computed leave two attributes on the model, read here:
`_meshforge_batch_transform(x, y) -> (x, y, positions)` (context parallelism) and
`_meshforge_loss_context()` (vocabulary-parallel loss under tensor parallelism).

Loss normalisation: every micro batch has the same number of tokens on every
rank (fixed-length sequences, equal cp chunks), so the mean of per-micro-batch
means, averaged over the data-parallel ranks by the gradient reduction, is
exactly the mean over all tokens of the global batch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def lm_loss(output, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cross-entropy mean over tokens, auxiliary loss or None); models may return (logits, aux_loss)."""
    aux = None
    if isinstance(output, tuple):
        output, aux = output
    ce = F.cross_entropy(output.flatten(0, 1).float(), labels.flatten())
    if hasattr(ce, "full_tensor"):  # vocabulary-parallel loss (TP): a replicated DTensor -> plain tensor
        ce = ce.full_tensor()
    return ce, aux


class ParallelModel:
    def __init__(self, model: nn.Module, strategy, mesh_ctx, device: torch.device, precision: str = "fp32"):
        self.parts = [model]
        self.strategy, self.mesh_ctx, self.device = strategy, mesh_ctx, device
        self.precision = precision

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run every micro batch; returns the mean cross-entropy over the global batch (same on every rank)."""
        model = self.model
        transform = getattr(model, "_meshforge_batch_transform", None)
        loss_ctx = getattr(model, "_meshforge_loss_context", None) or contextlib.nullcontext
        n = len(micro_batches)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            positions = None
            if transform is not None:
                x, y, positions = transform(x, y)
            with self.strategy.micro_step(model, is_last=i == n - 1):
                with self.autocast():
                    out = model(x) if positions is None else model(x, positions)
                with loss_ctx():
                    ce, aux = lm_loss(out, y)
                    loss = ce if aux is None else ce + aux
                    (loss / n).backward()
            total += ce.detach().float()
        self.strategy.finish_grad_sync(model)
        return self.reduce_loss(total / n)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Average the logged loss over the ranks that saw different data (dp and cp), not over tp replicas."""
        if self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1:
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.mesh_ctx.group("dp_cp"))
        return loss

    # --- thin forwards to the strategy, over every part -------------------------------------
    def param_groups(self, weight_decay: float) -> list[dict]:
        groups: list[dict] = []
        for part in self.parts:
            groups += self.strategy.optimizer_param_groups(part, weight_decay)
        return [g for g in groups if g["params"]]

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.strategy.clip_grad_norm_(self.model, max_norm)
        from meshforge.distributed.grad_norm import clip_grad_norm_

        params = [p for part in self.parts for p in part.parameters()]
        return clip_grad_norm_(params, max_norm, self.mesh_ctx)

    def after_optimizer_step(self) -> None:
        for part in self.parts:
            self.strategy.after_optimizer_step(part)

    def zero_grad(self, optimizer) -> None:
        for part in self.parts:
            self.strategy.zero_grad(part, optimizer)

    def train(self) -> None:
        for part in self.parts:
            part.train()

    def unwrapped_parts(self) -> list[nn.Module]:
        return [self.strategy.unwrap(p) for p in self.parts]
