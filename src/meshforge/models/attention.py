"""Attention of packed sequences: causal AND same-document, as a dense mask or a FlexAttention block mask.

The choice follows the device of the document ids, so every caller (training, validation, CP, TP/SP) gets the
same rule without a config key:
- CUDA: a FlexAttention `BlockMask` and a compiled `flex_attention`. SDPA with a dense boolean mask leaves flash
  (and with grouped-query heads it falls to the math kernel, which materialises the S x S scores); the block mask
  skips the blocks that cross a document or lie above the diagonal.
- elsewhere (CPU, meta): the dense (B, 1, S, S) boolean mask through `scaled_dot_product_attention`
  (FlexAttention has no CPU backward in torch 2.13, and its eager forward there is a reference implementation).

Layers with their own attention rule (`attend`): a sliding window (a query sees the `window` latest keys, itself
included: HF's `q - k < sliding_window`), a softmax scale other than 1/sqrt(head_dim), and attention sinks (a
learned logit per head in the softmax denominator, GPT-OSS: `p = exp(s) / (sum exp(s) + exp(sink))`, the sink
itself attends to nothing). The window is one more condition of the boolean mask (or the block mask's `mask_mod`
on CUDA); sinks are an explicit extra logit column where the scores are materialised (CPU, and the dense path of
context parallelism), and on CUDA a rescaling of FlexAttention's output by its log-sum-exp,
`out * sigmoid(lse - sink)`, which is the same quantity.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> (B, 1, S, S) boolean mask: causal, within a document."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return (document_ids[:, :, None] == document_ids[:, None, :]).logical_and(causal)[:, None]


def document_block_mask(document_ids: torch.Tensor, q_positions: torch.Tensor | None = None,
                        compiled: bool | None = None):
    """(B, S) document ids -> a FlexAttention `BlockMask` (causal, within a document; heads broadcast).
    `q_positions` (context parallelism): the global positions of the queries this rank holds, attending to all S
    keys. `compiled` (default: on CUDA) builds it with a compiled `create_block_mask`, which never holds the
    Q x S mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = document_ids
    if q_positions is None:
        def same_document_causal(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
    else:
        def same_document_causal(b, h, q_idx, kv_idx):
            pos = q_positions[q_idx]
            return (ids[b, pos] == ids[b, kv_idx]) & (pos >= kv_idx)

    build = _compiled_create_block_mask() if (ids.is_cuda if compiled is None else compiled) else create_block_mask
    b, s = ids.shape
    q_len = s if q_positions is None else q_positions.shape[0]
    return build(same_document_causal, b, None, q_len, s, device=ids.device)


def document_mask(document_ids: torch.Tensor):
    """The packed-sequence mask for the device of `document_ids`: a block mask on CUDA, else the dense mask."""
    return document_block_mask(document_ids) if document_ids.is_cuda else dense_document_mask(document_ids)


def is_block_mask(mask) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None
                     ) -> torch.Tensor:
    """(B, H, S, D) attention under a packed-sequence mask of either kind (`document_mask`)."""
    gqa = k.shape[1] != q.shape[1]
    if is_block_mask(mask):
        flex = _compiled_flex_attention() if q.is_cuda else _eager_flex_attention()
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


# ------------------------------------------------------------------ windows, scales and sinks
def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None, q_docs: torch.Tensor | None = None,
            k_docs: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query attends to, as a boolean mask ((B or 1), 1, Sq, Sk): causal on the global positions
    `q_pos` (Sq,) and `k_pos` (Sk,), within `window` (q - k < window), within a document (`q_docs` (B, Sq),
    `k_docs` (B, Sk))."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok = ok & (diff < window)
    ok = ok[None, None]
    if q_docs is not None:
        ok = ok & (q_docs[:, :, None] == k_docs[:, None, :])[:, None]
    return ok


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, Sq, D) attention of q against (B, Hkv, Sk, D) keys and values where the boolean mask `ok` allows;
    with `sinks` (H,) one more logit per head in each softmax, exactly as transformers' GPT-OSS eager attention
    (the scores are materialised; the softmax runs in fp32)."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~ok, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the softmax in fp32 at least
    probs = (logits - logits.amax(-1, keepdim=True)).softmax(-1)[..., :-1]
    return probs.to(v.dtype) @ v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, window: int | None = None,
           scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (B, H, S, D) self-attention of one layer: `mask` (a packed batch's `document_mask`, else None),
    a sliding `window`, a softmax `scale` (None: 1/sqrt(D)) and attention `sinks` (H,) of this rank's heads."""
    if window is None and sinks is None:
        if mask is not None:
            return masked_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if q.is_cuda and (mask is None or is_block_mask(mask)):
        return _flex_attend(q, k, v, mask, window, scale, sinks)
    # the queries are the last Sq of the Sk keys: Sq < Sk when a KV cache holds the earlier ones (generation, whose
    # dense mask hides the left padding, so key index differences are position differences)
    k_pos = torch.arange(k.shape[-2], device=q.device)
    ok = allowed(k_pos[k.shape[-2] - q.shape[-2]:], k_pos, window)
    if mask is not None:
        ok = ok & mask
    return dense_attention(q, k, v, ok, scale, sinks)


def _flex_attend(q, k, v, mask, window, scale, sinks):
    """CUDA: FlexAttention under the (document and) window block mask; sinks rescale the output by its
    log-sum-exp (transformers does the same for GPT-OSS)."""
    block = _windowed_block_mask(mask, window, q.shape[0], q.shape[-2], q.device)
    flex = _compiled_flex_attention()
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return flex(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # older torch: return_lse
        out, lse = flex(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa, return_lse=True)
    else:
        out, aux = flex(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        lse = aux.lse
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # sum exp(s) / (sum exp(s) + exp(sink))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


_BLOCK_MASKS: dict = {}


def _windowed_block_mask(mask, window, batch: int, s: int, device):
    """The block mask of one kind of layer: causal (and within a document: `mask`, the batch's block mask) and
    within `window`; kept for the batch's mask object so the layers of one forward build it once."""
    from torch.nn.attention.flex_attention import and_masks

    key = (id(mask), window, batch, s, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def in_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    mods = [mask.mask_mod if mask is not None else causal] + ([in_window] if window is not None else [])
    build = _compiled_create_block_mask()
    block = build(and_masks(*mods), batch if mask is not None else None, None, s, s, device=device)
    if len(_BLOCK_MASKS) > 16:
        _BLOCK_MASKS.clear()
    _BLOCK_MASKS[key] = (mask, block)
    return block


@functools.cache
def _compiled_flex_attention():
    """FlexAttention only runs as a fused kernel when compiled (eager is an unfused reference); compiled once."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


def _eager_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention
