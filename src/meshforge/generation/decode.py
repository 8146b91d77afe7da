"""The decoding loop: token ids in, new token ids out, on a plain model or a live parallel one.

- `Sampling`: greedy (temperature 0) or temperature, then top-k, then top-p (transformers' order), each row drawn
  from its own `torch.Generator` seeded with `seed`: the same seed gives a prompt the same text whatever else is in
  its batch (and in training's samples, which run one prompt at a time), and the global RNG is never touched.
- `generate_ids`: a batch of prompts, left-padded (each row's positions count from its first real token, pad keys
  hidden: models/kv_cache.py), each step feeding only the new token with the KV cache, or the whole sequence
  without it (`use_cache=False`, the same mask: a full recompute). A row stops at a stop id (kept) or at
  `max_new_tokens`, or where the model's context is full; the loop ends when every row has stopped.
- `generate_live`: one prompt on a model as training holds it (FSDP, TP: every rank calls it with the same prompt
  and seed and runs the same forwards, which the sharded model needs). No cache: training's own forward on the
  whole sequence, right-padded to a multiple of `pad_to` (sequence parallelism splits the sequence over the TP
  ranks; a causal model's logits at the last real token do not see the padding). Vocabulary-sharded logits (TP's
  DTensor) are gathered before the choice, so every rank picks the same token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from meshforge.models.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def problems(self, prefix: str = "--") -> list[str]:
        out = []
        if not self.temperature >= 0:
            out.append(f"{prefix}temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            out.append(f"{prefix}top-k={self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            out.append(f"{prefix}top-p={self.top_p} must be in (0, 1]")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            out.append(f"{prefix}top-k/top-p sample, but temperature is 0 (greedy): set a temperature > 0")
        return out


def pick(logits: torch.Tensor, s: Sampling, generators: list[torch.Generator] | None) -> torch.Tensor:
    """(B, V) float logits -> (B,) next token ids (row i drawn with `generators[i]`)."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        ordered, idx = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > s.top_p  # tokens after the first that reach top_p (the best one stays)
        logits = logits.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


def full_logits(out) -> torch.Tensor:
    """The model's output as plain full-vocabulary logits (a tuple's first item; a TP DTensor gathered)."""
    out = out[0] if isinstance(out, tuple) else out
    return out.full_tensor() if isinstance(out, DTensor) else out


def _generators(device: torch.device, s: Sampling, rows: int) -> list[torch.Generator] | None:
    return None if s.temperature == 0 else [torch.Generator(device).manual_seed(s.seed) for _ in range(rows)]


@torch.no_grad()
def generate_ids(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                 stop_ids: set[int], context: int, use_cache: bool = True, pad_id: int = 0) -> list[list[int]]:
    """The new tokens of each prompt (module docstring); `model(tokens, positions, cache=...)` returns logits."""
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, longest - len(p):] = True
    generators = _generators(device, sampling, len(prompts))
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    cache, new, new_valid, out = KVCache(), tokens, valid, []
    for _ in range(min(max_new_tokens, context - longest)):
        if not use_cache:  # the whole sequence again, under the same mask
            cache, new, new_valid = KVCache(), tokens, valid
        cache.extend(new_valid)
        logits = full_logits(model(new, cache.positions(new.shape[1]), cache=cache))[:, -1].float()
        nxt = pick(logits, sampling, generators).masked_fill(done, pad_id)
        out.append(nxt)
        done |= torch.isin(nxt, stops)
        new, new_valid = nxt[:, None], ~done[:, None] | torch.isin(nxt, stops)[:, None]
        tokens, valid = torch.cat([tokens, new], 1), torch.cat([valid, new_valid], 1)
        if bool(done.all()):
            break
    return [_until_stop(row, stop_ids) for row in (torch.stack(out, 1).tolist() if out else [[]] * len(prompts))]


def _until_stop(row: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stop_ids:
            return row[:i + 1]
    return row


@torch.no_grad()
def generate_live(forward: Callable[[torch.Tensor], object], prompt: list[int], max_new_tokens: int,
                  sampling: Sampling, stop_ids: set[int], context: int, device: torch.device, pad_to: int = 1,
                  pad_id: int = 0) -> list[int]:
    """One prompt's new tokens through `forward(tokens) -> logits` on the whole (right-padded) sequence."""
    generators = _generators(device, sampling, 1)
    seq, new = list(prompt), []
    for _ in range(min(max_new_tokens, context - len(prompt))):
        width = -(-len(seq) // pad_to) * pad_to
        x = torch.tensor([seq + [pad_id] * (width - len(seq))], dtype=torch.long, device=device)
        logits = full_logits(forward(x))[:, len(seq) - 1].float()
        t = int(pick(logits, sampling, generators)[0])
        seq.append(t)
        new.append(t)
        if t in stop_ids:
            break
    return new
