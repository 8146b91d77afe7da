"""The parallel model runtime: run one global batch through a parallelised model.

`ParallelModel` is what the trainer holds: the model part(s) this rank runs, the strategy that wraps them,
and the forward/backward of one global batch, applying the batch transform and loss context that
`parallelize_model` returned. Pipeline parallelism subclasses it (its schedule drives forward and backward).

Loss normalisation: the loss is the sum of token cross-entropies over the global batch divided by its count of
label tokens (labels of -100 carry none), whatever the split into micro batches and ranks: micro batches may hold
different numbers of label tokens (SFT masks, padding), so a mean of per-micro-batch means would be wrong. The
count is taken once per step, before the forward, from this rank's labels, and summed over the dp and cp ranks
by one all-reduce of a device tensor (no host sync). Each rank backpropagates ce_sum * (dp*cp) / count: the
gradient reduction averages over the dp*cp ranks, which gives sum(ce) / count. An MoE's auxiliary loss keeps its
per-micro-batch mean.

Nothing here reads a tensor back to the host: the loss stays a device tensor (the trainer reads it on log
steps only).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from meshforge.distributed.expert_parallel import update_router_biases
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.parallelize import Parallelized
from meshforge.distributed.strategy import Strategy
from meshforge.models.loss import IGNORE_INDEX, lm_loss


def packed_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> positions counted from each document's first token."""
    idx = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, document_ids[:, 1:] != document_ids[:, :-1]], dim=1)
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


class ParallelModel:
    def __init__(self, parts: list[Parallelized], mesh_ctx: MeshContext, device: torch.device,
                 precision: str = "fp32"):
        self.parts = [p.model for p in parts]
        self.strategy: Strategy = parts[-1].strategy
        self.batch_transform = parts[0].batch_transform
        self.loss_context = parts[-1].loss_context
        self.mesh_ctx, self.device, self.precision = mesh_ctx, device, precision

    @property
    def model(self) -> nn.Module:
        return self.parts[0]

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run every micro batch; returns the mean cross-entropy over the global batch's label tokens (same on
        every rank)."""
        model = self.model
        n = len(micro_batches)
        micro_batches = self._to_device(micro_batches)
        count = self.global_label_count([mb[1] for mb in micro_batches])
        scale = self.mesh_ctx.size("dp_cp") / count
        total = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            with self.strategy.micro_step(model, is_last=i == n - 1):
                out, y = self._forward(model, mb)
                with self.loss_context():
                    parts = lm_loss(out, y)
                    loss = parts.ce_sum * scale
                    if parts.aux is not None:
                        loss = loss + parts.aux / n
                    loss.backward()
            total += parts.ce_sum.detach().float()
        self.strategy.finish_grad_sync(model)
        return self.reduce_loss(total, count)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only (validation): (cross-entropy sum, label count) of the global batch, the same on every
        rank. Touches no gradient, optimizer or RNG state."""
        micro_batches = self._to_device(micro_batches)
        count = self.global_label_count([mb[1] for mb in micro_batches], clamp=False)
        total = torch.zeros((), device=self.device)
        for mb in micro_batches:
            out, y = self._forward(self.model, mb)
            with self.loss_context():
                total += lm_loss(out, y).ce_sum.detach().float()
        return self.reduce_loss(total, torch.ones((), device=self.device)), count

    def _to_device(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(t.to(self.device, non_blocking=True) for t in mb) for mb in micro_batches]

    def _forward(self, model, micro_batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the model's output, the labels it answers) on one micro batch `(inputs, labels[, document ids])`, after
        the batch transform (this rank's cp share); packed sequences (document ids) get positions that restart per
        document and a document mask (the pipeline hands them to its stages itself)."""
        x, y, *docs = micro_batch
        positions = packed_positions(docs[0]) if docs else None
        if self.batch_transform is not None:
            x, y, positions, *docs = self.batch_transform(x, y, positions, *docs)
        with self.autocast():
            if docs:
                return model(x, positions, docs[0]), y
            return (model(x) if positions is None else model(x, positions)), y

    def global_label_count(self, labels: list[torch.Tensor], clamp: bool = True) -> torch.Tensor:
        """The global batch's label tokens (fp32, at least 1), from this rank's full-length labels (before any
        cp split): summed over the dp_cp ranks, where each dp rank's labels are held by its cp ranks."""
        count = torch.stack([(y != IGNORE_INDEX).sum() for y in labels]).sum()
        if self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1:
            dist.all_reduce(count, group=self.mesh_ctx.group("dp_cp"))
            count = count // self.mesh_ctx.cp_size
        return count.float().clamp(min=1) if clamp else count.float()

    def reduce_loss(self, ce_sum: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The logged loss: this rank's cross-entropy sum, summed over the ranks that saw different data (dp and
        cp, not tp replicas), over the global count."""
        if self.mesh_ctx.world_size > 1 and self.mesh_ctx.size("dp_cp") > 1:
            ce_sum = ce_sum.clone()
            dist.all_reduce(ce_sum, group=self.mesh_ctx.group("dp_cp"))
        return ce_sum / count

    # --- thin forwards to the strategy, over every part -------------------------------------
    def param_groups(self, weight_decay: float) -> list[dict]:
        groups: list[dict] = []
        for part in self.parts:
            groups += self.strategy.optimizer_param_groups(part, weight_decay)
        return [g for g in groups if g["params"]]

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        return self.strategy.clip_grad_norm_(self.model, max_norm)

    def after_optimizer_step(self) -> None:
        for part in self.parts:
            self.strategy.after_optimizer_step(part)
        update_router_biases(self.unwrapped_parts(), self.mesh_ctx)  # MoE auxiliary-loss-free balancing, if on

    def zero_grad(self, optimizer) -> None:
        for part in self.parts:
            self.strategy.zero_grad(part, optimizer)

    def train(self) -> None:
        for part in self.parts:
            part.train()

    def eval(self) -> None:
        """Eval mode (generation from the live model: logits from the head, no MoE load counted)."""
        for part in self.parts:
            part.eval()

    def unwrapped_parts(self) -> list[nn.Module]:
        """The modules holding this rank's parameters under the whole model's names (checkpoints, export)."""
        return [self.strategy.unwrap(p) for p in self.parts]

    def state_parts(self) -> list[nn.Module]:
        """What the strategy's state-dict methods take: the parallelised parts (the strategy sees through
        its own wrappers)."""
        return self.parts

    def optimizer_state_dict(self, optimizer, full: bool = False) -> dict:
        """The optimizer's state by parameter name (checkpoints), through the strategy."""
        return self.strategy.optimizer_state_dict(self.state_parts(), optimizer, full=full)

    def load_optimizer_state_dict(self, optimizer, state_dict: dict) -> None:
        self.strategy.load_optimizer_state_dict(self.state_parts(), optimizer, state_dict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full CPU tensor under the whole model's names; all ranks must call."""
        out: dict[str, torch.Tensor] = {}
        for part in self.state_parts():
            sd = self.strategy.full_state_dict(part)
            out.update({k: v.detach().float().cpu().clone() for k, v in sd.items()})
        return out
