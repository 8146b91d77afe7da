"""The fused (chunked) loss under tensor parallelism: `tp_head_loss`, installed by `apply_tp`'s loss context.

The head's weight is a DTensor sharded over the vocabulary (`vocab_output`: rows split over tp, torch.chunk
sizes); the final hidden states are replicated, or sharded along the sequence under sequence parallelism. As
Megatron's vocabulary-parallel cross-entropy, fused with the head's matmul and chunked as `models.loss`'s:

forward   each tp rank projects the tokens on its vocabulary rows one chunk at a time, keeping per token the
          log-sum-exp over its rows and its row's logit of the label (0 where the label is another rank's);
          one all-gather over tp of those two numbers per token gives the whole vocabulary's log-sum-exp and
          the label's logit. No rank ever holds more than one chunk of its [tokens, vocab/tp] logits.
backward  recomputes each chunk's local logits: softmax - onehot on this rank's rows; the weight's gradient is
          local (its rows), the hidden states' is a partial sum over the vocabulary shards, summed over tp: an
          all-reduce, or (sequence parallelism) the reduce-scatter that is the backward of the sequence gather.

Saved for backward: the hidden states (gathered along the sequence under SP), the int64 labels and one fp32
log-sum-exp per token (the weight is a parameter). A replicated head (`tp_plan` output: replicate) takes the
single-device chunked loss on the gathered hidden states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.tensor import DTensor, Replicate

from meshforge.models.loss import CHUNK_LOGIT_ELEMENTS, IGNORE_INDEX, chunked_cross_entropy


def tp_head_loss(hidden, weight, labels: torch.Tensor, dtype: torch.dtype | None = None,
                 chunk_tokens: int | None = None) -> torch.Tensor:
    """Cross-entropy sum of (hidden @ weight.T) against labels, the same on every tp rank."""
    if not isinstance(weight, DTensor) or not any(p.is_shard(0) for p in weight.placements):
        if isinstance(hidden, DTensor):  # sequence parallel: every rank needs every token (backward: its slice)
            hidden = hidden.redistribute(hidden.device_mesh, [Replicate()]).to_local()
        w = weight.full_tensor() if isinstance(weight, DTensor) else weight
        return chunked_cross_entropy(hidden, w, labels, dtype, chunk_tokens)
    mesh = weight.device_mesh
    group = mesh.get_group()
    reduce_grad = True
    if isinstance(hidden, DTensor):  # sequence-parallel shards: gathered here, reduce-scattered in backward
        hidden = all_gather_tensor_autograd(hidden.to_local(), gather_dim=1, group=group)
        reduce_grad = False
    vocab, tp = weight.shape[0], mesh.size()
    start = mesh.get_local_rank() * -(-vocab // tp)  # Shard(0) splits as torch.chunk
    w_local = weight.to_local()
    h = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_tokens or max(1, CHUNK_LOGIT_ELEMENTS // max(1, w_local.shape[0]))
    return _VocabParallelCE.apply(h, w_local, labels.reshape(-1), start, group, reduce_grad,
                                  dtype or h.dtype, chunk)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w_local, labels, start, group, reduce_grad, dtype, chunk):
        w = w_local.to(dtype)
        n, rows = h.shape[0], w_local.shape[0]
        local = labels - start
        mine = (labels != IGNORE_INDEX) & (local >= 0) & (local < rows)
        stats = torch.zeros(2, n, dtype=torch.float32, device=h.device)  # [this shard's lse, label logit]
        for s in range(0, n, chunk):
            logits = (h[s:s + chunk].to(dtype) @ w.t()).float()
            stats[0, s:s + chunk] = torch.logsumexp(logits, dim=-1) if rows else float("-inf")
            if rows:
                target = logits.gather(1, local[s:s + chunk].clamp(0, rows - 1).unsqueeze(1)).squeeze(1)
                stats[1, s:s + chunk] = torch.where(mine[s:s + chunk], target, 0.0)
            del logits
        everyone = torch.empty(dist.get_world_size(group) * 2, n, dtype=torch.float32, device=h.device)
        dist.all_gather_into_tensor(everyone, stats, group=group)
        everyone = everyone.view(-1, 2, n)
        lse = torch.logsumexp(everyone[:, 0], dim=0)
        valid = labels != IGNORE_INDEX
        total = torch.where(valid, lse - everyone[:, 1].sum(0), 0.0).sum()
        ctx.save_for_backward(h, w_local, labels, lse)
        ctx.start, ctx.group, ctx.reduce_grad, ctx.dtype, ctx.chunk = start, group, reduce_grad, dtype, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, w_local, labels, lse = ctx.saved_tensors
        dtype, chunk, rows = ctx.dtype, ctx.chunk, w_local.shape[0]
        w = w_local.to(dtype)
        local = labels - ctx.start
        mine = (labels != IGNORE_INDEX) & (local >= 0) & (local < rows)
        scale = (labels != IGNORE_INDEX).float() * grad_total
        grad_h = torch.zeros_like(h)  # (always: every tp rank must take part in its all-reduce)
        grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=w_local.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], chunk):
            if not rows:
                break
            hc = h[s:s + chunk].to(dtype)
            # d ce / d logits on this rank's rows = softmax - onehot(label if it is one of them), 0 where ignored
            g = (hc @ w.t()).float().sub_(lse[s:s + chunk].unsqueeze(1)).exp_()
            hit = mine[s:s + chunk].float().neg().unsqueeze(1)
            g.scatter_add_(1, local[s:s + chunk].clamp(0, rows - 1).unsqueeze(1), hit)
            g = g.mul_(scale[s:s + chunk].unsqueeze(1)).to(dtype)
            grad_h[s:s + chunk] = g @ w
            if grad_w is not None:  # a frozen head (LoRA) takes none
                grad_w.add_(g.t() @ hc)
            del g
        if ctx.reduce_grad:  # the hidden states were replicated: their gradient is the sum over the shards
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h, None if grad_w is None else grad_w.to(w_local.dtype), None, None, None, None, None, None
