"""A key/value cache for incremental decoding, in plain tensors (no distributed code).

Generation (`meshforge.generation`) owns one `KVCache` per batch of sequences and hands it to the model's forward;
the model passes each block its layer's slot (`at(i)`), whose attention appends the new tokens' keys and values and
attends over everything cached so far. The cache also records which positions hold tokens (`valid`: batched
prompts are left-padded), so the mask of a forward (`attention_mask`) is causal over the cached + new tokens and
hides pad keys. A pad query attends to itself only (an all-masked row would be NaN in SDPA, and a NaN value of a
pad key multiplied by its zero weight is still NaN); its output is never read.

Without reuse (a fresh cache per forward over the whole sequence) the same mask drives a full recompute, so the
cached and uncached paths differ only in what they recompute.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One attention layer's keys and values, (B, H_kv, S, D), grown along S."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' (B, H, S_new, D) keys and values; returns all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    def __init__(self):
        self.layers: dict[int, LayerCache] = {}
        self.valid: torch.Tensor | None = None  # (B, S) True where a token (not padding) sits

    def extend(self, valid: torch.Tensor) -> None:
        """Before a forward: which of the tokens it feeds are real (B, S_new)."""
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)

    def at(self, i: int) -> LayerCache:
        return self.layers.setdefault(i, LayerCache())

    def attention_mask(self, s_new: int) -> torch.Tensor:
        """(B, 1, s_new, S) boolean: the new queries see the valid keys up to their own position (and themselves)."""
        s = self.valid.shape[1]
        q = torch.arange(s - s_new, s, device=self.valid.device)[:, None]
        k = torch.arange(s, device=self.valid.device)[None, :]
        mask = (self.valid[:, None, :] & (k <= q)[None]) | (k == q)[None]
        return mask[:, None]

    def positions(self, s_new: int) -> torch.Tensor:
        """(B, s_new) RoPE positions of the new tokens: counted from each row's first real token."""
        return (self.valid.long().cumsum(1) - 1).clamp(min=0)[:, -s_new:]
