"""Validation every `training.val_every` steps (and at the last step): the mean cross-entropy over the label tokens
of the first `data.validation.batches` global batches of the validation data (unshuffled), and its perplexity.

The batches come from a loader of their own, rebuilt at each validation, so the training loader's position is
untouched; the forward runs under `torch.no_grad` with the RNG forked, so the training RNG is untouched too:
exact resume holds with validation on. The numbers are the same at any world size and parallelism (the global
batches are, and `ParallelModel.evaluate` sums over dp/cp ranks and pipeline microbatches).

With `data.mix`, each source with a validation is evaluated on its own (`val_loss/<name>`, `val_ppl/<name>`);
`val_loss` is then their mean weighted by the mix weights (the loss on the mixture those sources make).
"""

from __future__ import annotations

import math
import time

import torch

from meshforge.data import ShardedBatchLoader


class Validation:
    def __init__(self, cfg, mesh_ctx, pm, source):
        t = cfg.training
        self.pm, self.every, self.max_steps = pm, t.val_every, t.max_steps
        self.G, self.m, self.seed = t.global_batch_size, t.micro_batch_size, cfg.run.seed
        self.dp_rank, self.dp_size = mesh_ctx.dp_rank, mesh_ctx.dp_size
        # {None: source}, or {name: source} of the mix's sources with a validation, with their settings
        mix = dict(zip(cfg.data.mix_names(), cfg.data.mix or []))
        self.sources = source if isinstance(source, dict) else {None: source}
        self.weights = {n: mix[n].weight if n is not None else 1.0 for n in self.sources}
        # the first `batches` global batches; at least one (a smaller set is repeated to fill it)
        self.batches = {n: min((mix[n] if n is not None else cfg.data).validation.batches,
                               max(1, s.num_samples // self.G)) for n, s in self.sources.items()}
        self.device = pm.device

    @classmethod
    def build(cls, cfg, mesh_ctx, pm, source) -> Validation | None:
        return None if source is None or not cfg.training.val_every else cls(cfg, mesh_ctx, pm, source)

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.max_steps

    def __call__(self, step: int, result, log) -> float:
        """Validate, record in `result.validations` and the log; returns the seconds it took (not training time,
        so the throughput window leaves it out)."""
        t0 = time.perf_counter()
        result.validations.append(self.run(step))
        log.log(result.validations[-1])
        return time.perf_counter() - t0

    def run(self, step: int) -> dict:
        out = {"step": step}
        losses = {name: self._loss(name) for name in self.sources}
        if None in losses:
            loss = losses[None]
        else:
            for name, value in losses.items():
                out.update({f"val_loss/{name}": value, f"val_ppl/{name}": _ppl(value)})
            total = sum(self.weights.values())
            loss = sum(self.weights[n] * v for n, v in losses.items()) / total
        return {**out, "val_loss": loss, "val_ppl": _ppl(loss)}

    def _loss(self, name: str | None) -> float:
        loader = ShardedBatchLoader(self.sources[name], self.G, self.m, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                    seed=self.seed, shuffle=False)
        ce = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for _ in range(self.batches[name]):
                c, n = self.pm.evaluate(loader.next_batch())
                ce, count = ce + c, count + n
        return (ce / count.clamp(min=1)).item()


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 700.0))
