"""Context parallelism: each sequence is split over the `cp` ranks, attention stays exact and causal.

`apply_cp(model, mesh_ctx, dcfg)` does two things:

1. **Shards every micro-batch**: it returns the batch transform the step applies (`distributed/runtime.py`). The
   sequence is cut into 2*cp equal chunks; cp rank r keeps chunks r and 2*cp-1-r (one early, one late), so every
   rank has the same causal work. Input ids, labels and position ids are sharded the same way; RoPE uses the
   true positions. Each rank's cross-entropy is the mean over its B*S/cp tokens; all ranks hold the same number
   of tokens, so the average over the cp ranks (done by the data-parallel gradient reduction over
   `dp_shard_cp`/`dp_cp`, and by `ParallelModel.reduce_loss` for the logged value) is exactly the mean over all
   tokens. Uneven chunks are not allowed: `training.seq_len` must divide by 2*cp_size (a config rule).

2. **Replaces every attention slot** the model declares (its swappable attention op, see the model contract)
   with `ContextParallelAttention`.

The algorithm: all-gather K/V, with recomputation in backward
-----------------------------------------------------------------
Forward: one `all_gather_into_tensor` of the stacked local (K, V) over the cp group, reorder the chunks to
global order, then for each of the two local query chunks (global chunk index i, c = S/(2cp) tokens) one
scaled-dot-product attention over the key prefix [0, (i+1)c) with a lower-right causal mask. On CUDA that is
`causal_lower_right` (flash / memory-efficient kernels); on CPU an explicit boolean mask (the SDPA CPU kernel).
Packed sequences (document ids) mask causal AND same-document with the full ids: on CUDA one FlexAttention call
of both local query chunks against the full K/V under a block mask built once per micro batch from the ids and
this rank's query positions; elsewhere a dense boolean mask per chunk.
Backward (a hand-written `autograd.Function`, collectives called directly, so gloo works and gradients are
exact; `torch.distributed.nn.functional.all_gather` gives wrong gradients on gloo): all-gather K/V again,
recompute the local attention under autograd, and `reduce_scatter_tensor` (sum) the gradients of the full
K/V back to the rank that owns each chunk.

Cost per attention layer and rank, with S the full sequence length, Hkv the local kv heads, D the head dim,
B the micro-batch and e the element size:
- traffic: forward all-gather 2*B*Hkv*S*D*e*(cp-1)/cp received; backward the same all-gather again plus a
  reduce-scatter of the same size. 3x one K/V all-gather per layer, not overlapped with compute here.
- memory kept for backward: only the local q, k, v (size S/cp), so activation memory per rank falls as 1/cp
  (measured by benchmarks/cp_activation_memory.py). The full-sequence K/V (2*B*Hkv*S*D*e, and the
  GQA-expanded copy on CUDA) exists only transiently, inside one layer's forward or backward.
- compute: the attention forward is done twice (forward, and recomputed in backward); the projections and
  MLP are not affected.
A ring (pass K/V blocks around the ring, online softmax) would overlap communication and keep the transient
K/V at 2/cp of the sequence; the all-gather is simpler to make exact on every backend and is what we ship.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshforge.errors import ConfigError
from meshforge.models import contract_of, set_submodule
from meshforge.models.attention import allowed, dense_attention, document_block_mask, is_block_mask, masked_attention


# ------------------------------------------------------------------------------ load balancing
def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunks r and 2*cp-1-r of 2*cp equal chunks."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*cp_size = {2 * cp_size} "
                         "(training.seq_len; causal load balancing needs equal chunks)")
    c = seq_len // (2 * cp_size)
    early = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    late_chunk = 2 * cp_size - 1 - cp_rank
    late = torch.arange(late_chunk * c, (late_chunk + 1) * c, device=device)
    return torch.cat([early, late])


class _Documents:
    """The document ids (B, S) of the micro batch in flight, in global order, shared by the batch transform (which
    sets them) and every cp attention (which masks with them). The step transforms a micro batch and runs its
    forward and backward before the next (activation checkpointing recomputes within that backward), and each
    attention call keeps its own reference for its backward, so the ids always belong to the batch computed.
    On CUDA `block_mask` holds the FlexAttention block mask of this rank's queries (built once per micro batch)."""

    def __init__(self):
        self.ids: torch.Tensor | None = None
        self.block_mask = None


class CPBatchTransform:
    """(x, y[, positions, document ids]) full sequences -> (x_local, y_local, positions_local[, document ids_local])
    for this cp rank (dim 1 is the sequence). Packed sequences bring their restarting positions and document ids;
    the full ids stay with the cp attention, so the load-balanced chunks see the same document boundaries."""

    def __init__(self, cp_size: int, cp_rank: int, documents: _Documents | None = None):
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.documents = documents or _Documents()

    def __call__(self, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor | None = None,
                 document_ids: torch.Tensor | None = None):
        idx = load_balanced_indices(x.shape[1], self.cp_size, self.cp_rank, device=x.device)
        self.documents.ids = document_ids
        self.documents.block_mask = (document_block_mask(document_ids, q_positions=idx)
                                     if document_ids is not None and document_ids.is_cuda else None)
        local = (x.index_select(1, idx), y.index_select(1, idx), idx if positions is None else
                 positions.index_select(1, idx))
        return local if document_ids is None else local + (document_ids.index_select(1, idx),)


# ------------------------------------------------------------------------------ attention
def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


class _CPGroup:
    """The cp process group and the chunk bookkeeping the attention function needs."""

    def __init__(self, group, cp_size: int, cp_rank: int):
        self.group, self.size, self.rank = group, cp_size, cp_rank

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local (B, H, S/cp, Dk) k and (B, H, S/cp, Dv) v -> full-sequence k, v in global token order (k and v
        travel side by side on the feature dim: their widths may differ, as in DeepSeek's latent attention)."""
        kv = torch.cat([k, v], dim=-1).contiguous()
        out = kv.new_empty((self.size * kv.shape[0],) + tuple(kv.shape[1:]))
        _all_gather(out, kv, self.group)
        out = out.unflatten(0, (self.size, kv.shape[0]))  # (cp, B, H, S/cp, Dk + Dv)
        c = kv.shape[-2] // 2
        # rank j holds chunks j and 2cp-1-j: first halves in rank order, then second halves in reverse
        early = out[..., :c, :].movedim(0, -3).flatten(-3, -2)  # (B, H, cp*c, Dk + Dv)
        late = out.flip(0)[..., c:, :].movedim(0, -3).flatten(-3, -2)
        full = torch.cat([early, late], dim=-2)
        return full[..., :k.shape[-1]], full[..., k.shape[-1]:]

    def reduce_scatter_kv(self, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients of full k, v (global order) -> summed gradients of this rank's local k, v."""
        full = torch.cat([dk, dv], dim=-1)  # (B, H, S, Dk + Dv)
        s = full.shape[-2]
        c = s // (2 * self.size)
        chunks = full.unflatten(-2, (2 * self.size, c))  # (B, H, 2cp, c, Dk + Dv)
        early, late = chunks[..., : self.size, :, :], chunks[..., self.size:, :, :].flip(-3)
        per_rank = torch.cat([early, late], dim=-2)  # (B, H, cp, 2c, Dk + Dv)
        per_rank = per_rank.movedim(-3, 0).flatten(0, 1).contiguous()  # (cp*B, H, 2c, Dk + Dv)
        out = per_rank.new_empty((dk.shape[0],) + tuple(per_rank.shape[1:]))
        _reduce_scatter(out, per_rank, self.group)
        return out[..., :dk.shape[-1]], out[..., dk.shape[-1]:]

    def local_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None,
                        rule: _LayerRule | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Exact causal attention of this rank's two query chunks against the full-sequence k, v; with the full
        (B, S) `documents` of packed sequences, also within a document (a dense boolean mask per chunk), or
        `documents` is the FlexAttention block mask of this rank's query positions (CUDA; one call). A layer with
        its own `rule` (sliding window, softmax scale) or `sinks` takes the dense path: the window is one more
        mask condition, the sinks an extra logit column (models/attention.py `dense_attention`)."""
        special = rule is not None or sinks is not None
        if documents is not None and is_block_mask(documents) and not special:
            return masked_attention(q, k, v, documents)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: expand kv heads (transient)
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        c = q.shape[-2] // 2
        outs = []
        for j, chunk in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            kv_len = (chunk + 1) * c
            qj = q[..., j * c:(j + 1) * c, :]
            if special:
                pos = torch.arange(kv_len, device=q.device)
                docs = documents if documents is not None and not is_block_mask(documents) else None
                ok = allowed(pos[kv_len - c:], pos, rule.window if rule else None,
                             None if docs is None else docs[:, kv_len - c:kv_len], None if docs is None else
                             docs[:, :kv_len])
                outs.append(dense_attention(qj, k[..., :kv_len, :], v[..., :kv_len, :], ok,
                                            rule.scale if rule else None, sinks))
                continue
            if documents is not None:
                causal = torch.ones(c, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - c)
                same = documents[:, kv_len - c:kv_len, None] == documents[:, None, :kv_len]
                mask = same.logical_and(causal)[:, None]  # (B, 1, c, kv_len)
            elif q.device.type == "cuda":
                from torch.nn.attention.bias import causal_lower_right

                mask = causal_lower_right(c, kv_len)
            else:
                mask = torch.ones(c, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - c)
            outs.append(F.scaled_dot_product_attention(qj, k[..., :kv_len, :], v[..., :kv_len, :], attn_mask=mask))
        return torch.cat(outs, dim=-2)


class _LayerRule:
    """The attention rule of the slot a cp attention replaced: its sliding window and softmax scale."""

    def __init__(self, window: int | None, scale: float | None):
        self.window, self.scale = window, scale


class _AllGatherKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cp: _CPGroup, documents, rule):
        kf, vf = cp.gather_kv(k, v)
        out = cp.local_attention(q, kf, vf, documents, rule, sinks)
        ctx.save_for_backward(q, k, v, sinks)
        ctx.cp, ctx.documents, ctx.rule = cp, documents, rule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks = ctx.saved_tensors
        cp: _CPGroup = ctx.cp
        kf, vf = cp.gather_kv(k, v)
        with torch.enable_grad():
            q_, kf_, vf_ = (t.detach().requires_grad_(True) for t in (q, kf, vf))
            inputs = (q_, kf_, vf_)
            s_ = None
            if sinks is not None:
                s_ = sinks.detach().requires_grad_(True)
                inputs += (s_,)
            out = cp.local_attention(q_, kf_, vf_, ctx.documents, ctx.rule, s_)
            grads = torch.autograd.grad(out, inputs, dout)
        dk, dv = cp.reduce_scatter_kv(grads[1], grads[2])
        # the sinks' gradient from this rank's queries: the data-parallel reduction over the cp ranks adds the rest
        return grads[0], dk, dv, grads[3] if sinks is not None else None, None, None, None


class ContextParallelAttention(nn.Module):
    """Drop-in for a model's attention op: q, k, v are this rank's (B, H, S/cp, D) load-balanced shards. `window`
    and `scale`: the rule of the slot it replaces (a sliding-window layer's window, the softmax scale)."""

    def __init__(self, group, cp_size: int, cp_rank: int, documents: _Documents | None = None,
                 window: int | None = None, scale: float | None = None):
        super().__init__()
        self.cp = _CPGroup(group, cp_size, cp_rank)
        self.documents = documents or _Documents()
        self.rule = _LayerRule(window, scale) if window is not None or scale is not None else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`mask` (the model's document mask of packed sequences, built from this rank's shard) only says the
        batch is packed: the exact mask comes from the full document ids the batch transform kept. `sinks`: the
        layer's attention sinks (this rank's heads)."""
        if q.shape[-2] % 2:
            raise ValueError(f"context-parallel attention needs an even local sequence length, got {q.shape[-2]}")
        documents = None
        if mask is not None:
            documents = self.documents.ids
            if documents is None or documents.shape != (q.shape[0], q.shape[-2] * self.cp.size):
                raise RuntimeError("context-parallel attention got a document mask but not the micro batch's "
                                   "document ids (packed batches must go through the cp batch transform)")
            if self.documents.block_mask is not None and self.rule is None and sinks is None:
                documents = self.documents.block_mask  # CUDA: the block mask of the same ids
        return _AllGatherKVAttention.apply(q, k, v, sinks, self.cp, documents, self.rule)

    def extra_repr(self) -> str:
        rule = "" if self.rule is None else f", window={self.rule.window}, scale={self.rule.scale}"
        return f"cp_size={self.cp.size}, cp_rank={self.cp.rank}, all-gather K/V{rule}"


# ------------------------------------------------------------------------------ apply
def apply_cp(model: nn.Module, mesh_ctx, dcfg) -> CPBatchTransform:
    """Replace every attention slot of the model with the cp version; returns the step's batch transform."""
    cp_size, cp_rank, group = mesh_ctx.cp_size, mesh_ctx.cp_rank, mesh_ctx.group("cp")
    slots = contract_of(model).attention_slots()
    if not slots:
        raise ConfigError(f"distributed.cp_size={cp_size} needs a model that declares its attention slots "
                          f"(the model contract); {type(model).__name__} declares none: use a built-in model or "
                          "cp_size 1")
    documents = _Documents()  # packed sequences: the transform sets the micro batch's ids, the attentions read them
    for name in slots:
        slot = model.get_submodule(name)  # its attention rule (window, scale) goes on with the drop-in
        rule = getattr(slot, "window", None), getattr(slot, "scale", None)
        set_submodule(model, name, ContextParallelAttention(group, cp_size, cp_rank, documents, *rule))
    return CPBatchTransform(cp_size, cp_rank, documents)
