"""Perplexity on held-out data: every sample of a `data.*` source once, in order (no shuffle), read exactly as
training reads it (source kind, format, loss masking, packing, the tokenizer's rules); the mean cross-entropy over
its label tokens and its exponential. A `data.mix` is evaluated source by source (its weights do not apply: each
source's own numbers)."""

from __future__ import annotations

import math

import numpy as np
import torch

from meshforge.data import build_source
from meshforge.distributed.runtime import packed_positions
from meshforge.models.loss import lm_loss

MAX_SAMPLES = 2**20  # an endless source (synthetic) is evaluated on this many samples at most


@torch.no_grad()
def perplexity(em, data_cfg, seq_len: int, batch_size: int = 8, max_samples: int | None = None) -> dict:
    """{source name: {loss, ppl, tokens, samples}} (one entry `data` without a mix)."""
    if not data_cfg.tokenizer and em.tokenizer_path:  # the model's own tokenizer, unless data.tokenizer says
        data_cfg = data_cfg.model_copy(update={"tokenizer": em.tokenizer_path})
    if data_cfg.mix:
        names = data_cfg.mix_names()
        sets = {n: build_source(data_cfg.source_config(i), seq_len, em.args.vocab_size, 0)
                for i, n in enumerate(names)}
    else:
        sets = {"data": build_source(data_cfg, seq_len, em.args.vocab_size, 0)}
    return {name: _one(em.model, src, batch_size, max_samples) for name, src in sets.items()}


def _samples(source, batch_size: int, max_samples: int | None):
    """(inputs, labels[, document ids]) batches over every sample once, in order (a stream: to its end)."""
    limit = max_samples or MAX_SAMPLES
    if getattr(source, "streaming", False):
        from meshforge.data.streaming import StreamingBatchLoader

        reader, rows = StreamingBatchLoader(source, 1, 1), []
        while reader.position[0] == 0 and len(rows) < limit:  # epoch 0: the stream once
            rows.append(reader._window())
            if len(rows) == batch_size:
                seqs = torch.from_numpy(np.stack(rows))
                yield seqs[:, :-1], seqs[:, 1:]
                rows = []
        if rows:
            seqs = torch.from_numpy(np.stack(rows))
            yield seqs[:, :-1], seqs[:, 1:]
        return
    n = min(source.num_samples, limit)
    for i in range(0, n, batch_size):
        idx = list(range(i, min(n, i + batch_size)))
        if hasattr(source, "batch"):  # examples with label masks (SFT): (x, y[, document ids])
            yield tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in source.batch(idx))
        else:
            seqs = torch.from_numpy(source.samples(idx))
            yield seqs[:, :-1], seqs[:, 1:]


def _one(model, source, batch_size: int, max_samples: int | None) -> dict:
    device = next(model.parameters()).device
    ce, count, n = 0.0, 0, 0
    for x, y, *docs in _samples(source, batch_size, max_samples):
        x, y = x.to(device), y.to(device)
        if docs:  # packed: positions restart and attention stays within each document, as in training
            d = docs[0].to(device)
            out = model(x, packed_positions(d), d)
        else:
            out = model(x)
        ce += float(lm_loss(out, y).ce_sum)
        count += int((y != -100).sum())
        n += len(x)
    loss = ce / max(1, count)
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": count, "samples": n}
