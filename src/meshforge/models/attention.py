"""Attention of packed sequences: causal AND same-document, as a dense mask or a FlexAttention block mask.

The choice follows the device of the document ids, so every caller (training, validation, CP, TP/SP) gets the
same rule without a config key:
- CUDA: a FlexAttention `BlockMask` and a compiled `flex_attention`. SDPA with a dense boolean mask leaves flash
  (and with grouped-query heads it falls to the math kernel, which materialises the S x S scores); the block mask
  skips the blocks that cross a document or lie above the diagonal.
- elsewhere (CPU, meta): the dense (B, 1, S, S) boolean mask through `scaled_dot_product_attention`
  (FlexAttention has no CPU backward in torch 2.13, and its eager forward there is a reference implementation).
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


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """(B, H, S, D) attention under a packed-sequence mask of either kind (`document_mask`)."""
    gqa = k.shape[1] != q.shape[1]
    if is_block_mask(mask):
        flex = _compiled_flex_attention() if q.is_cuda else _eager_flex_attention()
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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
