"""The language-model loss of a model's output: token cross-entropy, plus the auxiliary loss an MoE returns.

Labels equal to `IGNORE_INDEX` carry no loss (prompt tokens, padding, document ends). The loss comes back as a
sum over label tokens and their count, so the caller can normalise by the count of the whole global batch
(across micro batches and ranks), which stays exact when micro batches hold different numbers of label tokens.

The fused loss: with `training.fused_loss` on, the model hands over its final hidden states and output-head
weight (`HeadInput`) instead of logits, and `chunked_cross_entropy` computes the output projection and the
cross-entropy a chunk of tokens at a time, in forward and in backward (which recomputes each chunk's logits).
At seq 4096 x micro-batch 4 x vocab 128,256 the plain path holds 8.4 GB of fp32 logits (plus their bf16 copy
and their gradient); the chunked path holds one chunk's logits (about 1 GiB) and one fp32 number per token.
A parallelisation that splits the head (tensor parallelism: its weight sharded over the vocabulary, the hidden
states possibly over the sequence) installs its own chunked loss for the duration of the loss
(`head_loss_override`), so models stay free of distributed code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the Hugging Face / torch convention for "no loss on this position"
CHUNK_LOGIT_ELEMENTS = 2**28  # logits per chunk (1 GiB in fp32): tokens per chunk = this // vocab
# (hidden, weight, labels, dtype, chunk_tokens) -> cross-entropy sum: the chunked loss of a split head
_HEAD_LOSS: ContextVar[Callable | None] = ContextVar("meshforge_head_loss", default=None)


@contextlib.contextmanager
def head_loss_override(fn: Callable) -> Iterator[None]:
    """Within: a `HeadInput` is turned into its loss by `fn` (same signature as `chunked_cross_entropy`)."""
    token = _HEAD_LOSS.set(fn)
    try:
        yield
    finally:
        _HEAD_LOSS.reset(token)


@dataclass
class LossParts:
    ce_sum: torch.Tensor  # fp32 sum of the token cross-entropy over label tokens
    n_tokens: torch.Tensor  # how many label tokens (labels != IGNORE_INDEX)
    aux: torch.Tensor | None  # an MoE's auxiliary (load-balancing) loss, already scaled by its coefficient

    @property
    def mean(self) -> torch.Tensor:
        """The cross-entropy mean over this micro batch's label tokens."""
        return self.ce_sum / self.n_tokens


class HeadInput(NamedTuple):
    """What a model returns instead of logits when the fused loss is on: tensors only (a NamedTuple, so DDP and
    FSDP see them, and a pipeline stage can hand them on). The hidden states are in the head's matmul dtype."""

    hidden: torch.Tensor  # (batch, seq, dim) final hidden states, after the final norm, in the matmul dtype
    weight: torch.Tensor  # (vocab, dim) the output head's weight

    @property
    def dtype(self) -> torch.dtype:
        """The matmul dtype the plain head would have used (autocast's, else the hidden states')."""
        return self.hidden.dtype


def head_input(hidden: torch.Tensor, weight: torch.Tensor) -> HeadInput:
    """Called inside the model's forward: the hidden states are cast as autocast would cast the head's input
    (the plain path's matmul keeps that cast for backward too)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return HeadInput(hidden, weight)


def lm_loss(output, labels: torch.Tensor, chunk_tokens: int | None = None) -> LossParts:
    """Cross-entropy of `output` (logits, a `HeadInput`, or either paired with an MoE's aux loss) against
    `labels`.

    Under a vocabulary-parallel output head the logits are a vocabulary-sharded DTensor and the caller runs this
    inside the parallelisation's loss context; the replicated result comes back as a plain tensor.
    """
    aux = None
    if isinstance(output, tuple) and not isinstance(output, HeadInput):
        output, aux = output
    if isinstance(output, HeadInput):
        fn = _HEAD_LOSS.get()
        if fn is None and any(hasattr(t, "placements") for t in (output.hidden, output.weight)):
            raise RuntimeError("the fused loss got a distributed (DTensor) head: run it inside the "
                               "parallelisation's loss context")
        ce = (fn or chunked_cross_entropy)(output.hidden, output.weight, labels, output.dtype, chunk_tokens)
        return LossParts(ce, (labels != IGNORE_INDEX).sum(), aux)
    ce = F.cross_entropy(output.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    if hasattr(ce, "full_tensor"):  # a replicated DTensor (vocabulary-parallel loss) -> plain tensor
        ce = ce.full_tensor()
    return LossParts(ce, (labels != IGNORE_INDEX).sum(), aux)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          dtype: torch.dtype | None = None, chunk_tokens: int | None = None) -> torch.Tensor:
    """Sum over label tokens of cross-entropy(hidden @ weight.T, labels), never holding more than one chunk
    of logits. The matmul runs in `dtype` (the head's), the softmax in fp32, as the plain path does."""
    h = hidden.reshape(-1, hidden.shape[-1])
    chunk = chunk_tokens or max(1, CHUNK_LOGIT_ELEMENTS // weight.shape[0])
    return _ChunkedCE.apply(h, weight, labels.reshape(-1), dtype or h.dtype, chunk)


class _ChunkedCE(torch.autograd.Function):
    """Saves hidden, weight, labels and one fp32 log-sum-exp per token; backward recomputes each chunk's
    logits and turns them into softmax - onehot, the gradient of the logits, chunk by chunk."""

    @staticmethod
    def forward(ctx, h, weight, labels, dtype, chunk):
        w = weight.to(dtype)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], chunk):
            logits = (h[s:s + chunk].to(dtype) @ w.t()).float()
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            y = labels[s:s + chunk]
            valid = y != IGNORE_INDEX
            target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse[s:s + chunk] - target, 0.0).sum()
            del logits
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.dtype, ctx.chunk = dtype, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, labels, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        w = weight.to(dtype)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], chunk):
            hc = h[s:s + chunk].to(dtype)
            logits = (hc @ w.t()).float()
            y = labels[s:s + chunk]
            valid = y != IGNORE_INDEX
            # d ce / d logits = softmax - onehot(label), zero on ignored tokens; in place to hold one chunk
            g = logits.sub_(lse[s:s + chunk].unsqueeze(1)).exp_()
            g.scatter_add_(1, y.clamp(min=0).unsqueeze(1), torch.full_like(lse[s:s + chunk], -1.0).unsqueeze(1))
            g.mul_((valid.float() * grad_total).unsqueeze(1))
            g = g.to(dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = g @ w
            if grad_w is not None:
                grad_w.add_(g.t() @ hc)  # accumulated in fp32 over chunks
            del logits, g
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None
