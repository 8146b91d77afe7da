"""Weighted mixing (`data.mix`): several sources blended by weight into one stream of global batches.

The schedule says which source each global sample position p takes, as a pure function of p, so global batch k
(positions k*G .. k*G+G-1) is the same samples at any world size and micro batch size, as for one source
(`loader.py`). Positions come in blocks of `BLOCK`: each block gives source s a quota q_s of the block (the
weights' largest-remainder apportionment of `BLOCK`, so a share is exact to 1/`BLOCK`), interleaved by smooth
weighted round robin (nginx's), which keeps every prefix of a block within about one sample of the weights:
1,000 samples match the weights to well under 1%. Position p is the n-th sample of its source, n counted over
the blocks before it; a random-access source maps n through its own seeded per-epoch permutation (each source
its own epochs), a streaming one (`streaming.py`) reads its windows in order.

State: the step (what every random-access source needs) and each stream's position, in `state_dict`, so a
resume at any world size continues with exactly the next global batch. A mixed run's fingerprint holds every
source's inputs and the weights; a resume from a single-source checkpoint (or another mix) is refused by it.
The realised proportions up to any step are exact counts of the schedule (`realised`), logged as `mix/<name>`.
"""

from __future__ import annotations

import numpy as np
import torch

from meshforge.data import fingerprint
from meshforge.data.loader import ShardedBatchLoader
from meshforge.errors import DataError

BLOCK = 10_000  # positions per schedule block: a source's share is exact to 1/BLOCK of the samples


class MixSchedule:
    """Which source, and which of its samples, each global sample position takes."""

    def __init__(self, weights: list[float], names: list[str]):
        w = np.asarray(weights, dtype=np.float64)
        exact = w / w.sum() * BLOCK
        quota = np.floor(exact).astype(np.int64)
        order = np.argsort(-(exact - quota), kind="stable")  # largest remainders first, ties by list order
        quota[order[:BLOCK - int(quota.sum())]] += 1
        for name, q, x in zip(names, quota, w):
            if q == 0:
                raise DataError(f"data.mix: source {name} (weight {x:g}) gets fewer than 1 in {BLOCK} samples: "
                                "raise its weight or leave it out")
        self.quota = quota
        src, nth, cum = [], [], [[0] * len(w)]
        current, counts = [0] * len(w), [0] * len(w)
        for _ in range(BLOCK):  # smooth weighted round robin: the source furthest behind its quota goes next
            current = [c + int(q) for c, q in zip(current, quota)]
            s = max(range(len(w)), key=current.__getitem__)
            current[s] -= BLOCK
            src.append(s)
            nth.append(counts[s])
            counts[s] += 1
            cum.append(list(counts))
        self.src, self.nth = np.asarray(src), np.asarray(nth)
        self.cum = np.asarray(cum, dtype=np.int64)  # (BLOCK + 1, sources): counts before each offset

    def at(self, p: int) -> tuple[int, int]:
        """(source, n): position p is that source's n-th sample."""
        b, o = divmod(p, BLOCK)
        s = int(self.src[o])
        return s, b * int(self.quota[s]) + int(self.nth[o])

    def counts(self, positions: int) -> np.ndarray:
        """Samples each source gave to the first `positions` positions."""
        b, o = divmod(positions, BLOCK)
        return b * self.quota + self.cum[o]


class MixedSource:
    """The sources of `data.mix` with their weights (and their validation sources); what the mixed loader reads."""

    mixed = True

    def __init__(self, names: list[str], weights: list[float], sources: list, validation: dict):
        self.names, self.weights, self.sources, self.validation = names, weights, sources, validation
        self.schedule = MixSchedule(weights, names)
        self.seq_len = sources[0].seq_len
        self.name = "mix:" + ",".join(names)
        self.packing = any(_packed(s) for s in sources)  # then every sample carries document ids
        self.inputs = {f"mix {n} {k}": v for n, s in zip(names, sources) for k, v in s.inputs.items()}
        self.inputs["data mix"] = " ".join(f"{n}={w!r}" for n, w in zip(names, weights))
        reports = [f"{n}: {s.report}" for n, s in zip(names, sources) if getattr(s, "report", None)]
        self.report = "; ".join(reports) or None

    def shares(self) -> dict[str, float]:
        total = sum(self.weights)
        return {n: w / total for n, w in zip(self.names, self.weights)}

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)


def _packed(source) -> bool:
    return bool(getattr(source, "packing", False))


class MixedBatchLoader(ShardedBatchLoader):
    """`ShardedBatchLoader` over a `MixedSource`: global batch k is positions k*G .. k*G+G-1 of the schedule, each
    from its source; (inputs, labels[, document ids]) micro batches of this rank's slice. Its state and resume
    checks are the plain loader's, plus each stream's position."""

    def __init__(self, source: MixedSource, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, allow_changed_inputs: bool = False):
        from meshforge.data.streaming import StreamingBatchLoader

        super().__init__(source, global_batch_size, micro_batch_size, dp_rank, dp_size, seed,
                         allow_changed_inputs=allow_changed_inputs)
        # a stream reads its windows in order: a one-window loader of its own keeps its position
        self.streams = {i: StreamingBatchLoader(s, 1, 1) for i, s in enumerate(source.sources)
                        if getattr(s, "streaming", False)}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _source_index(self, s: int, n: int) -> int:
        """Source s's n-th sample: its seeded permutation of epoch n // size (its own seed per source)."""
        size = self.source.sources[s].num_samples
        if size >= 2**32:  # synthetic: endless, every index its own sample
            return n
        epoch, offset = divmod(n, size)
        if (s, epoch) not in self._perms:
            if len(self._perms) > 2 * len(self.source.sources):
                self._perms.clear()
            self._perms[(s, epoch)] = np.random.default_rng([self.seed, s, epoch]).permutation(size)
        return int(self._perms[(s, epoch)][offset])

    def global_batch(self, k: int) -> list[tuple[int, int]]:
        """(source, sample index) of each position of global batch k (stream samples: their n-th window)."""
        out = []
        for p in range(k * self.G, (k + 1) * self.G):
            s, n = self.source.schedule.at(p)
            out.append((s, n if s in self.streams else self._source_index(s, n)))
        return out

    def batch(self, k: int) -> list[tuple[torch.Tensor, ...]]:
        if self.streams and k != self.step:
            raise RuntimeError(f"a mix with a streaming source reads batches in order: asked for {k}, next is "
                               f"{self.step}")
        picks = self.global_batch(k)
        windows = {p: self._window(s) for p, (s, _) in enumerate(picks) if s in self.streams}
        if self.streams:  # every rank reads every window, so each stream's position is the same on all
            self.step = k + 1
        mine = range(self.G)[self.local_slice()]
        by_source: dict[int, list[int]] = {}
        for p in mine:
            by_source.setdefault(picks[p][0], []).append(p)
        n = self.source.seq_len
        x = np.empty((len(mine), n), dtype=np.int64)
        y, docs = np.empty_like(x), np.zeros_like(x)
        row = {p: r for r, p in enumerate(mine)}
        for s, ps in by_source.items():
            src, rows = self.source.sources[s], [row[p] for p in ps]
            if s in self.streams:
                seqs = np.stack([windows[p] for p in ps])
                x[rows], y[rows] = seqs[:, :-1], seqs[:, 1:]
            elif hasattr(src, "batch"):  # examples with label masks (SFT): (x, y[, document ids])
                arrays = src.batch([picks[p][1] for p in ps])
                x[rows], y[rows] = arrays[0], arrays[1]
                if len(arrays) > 2:
                    docs[rows] = arrays[2]
            else:
                seqs = src.samples([picks[p][1] for p in ps])
                x[rows], y[rows] = seqs[:, :-1], seqs[:, 1:]
        parts = (x, y, docs) if self.source.packing else (x, y)
        return [tuple(torch.from_numpy(np.ascontiguousarray(a[i:i + self.m])) for a in parts)
                for i in range(0, len(mine), self.m)]

    def _window(self, s: int) -> np.ndarray:
        try:
            return self.streams[s]._window()
        except DataError as err:  # (a stream too short for one sequence is found when it is first read)
            raise DataError([f"data.mix[{s}] ({self.source.names[s]}): {p.removeprefix('data: ')}"
                             for p in err.problems]) from None

    def next_batch(self) -> list[tuple[torch.Tensor, ...]]:
        out = self.batch(self.step)
        if not self.streams:
            self.step += 1
        return out

    def realised(self, step: int | None = None) -> dict[str, float]:
        """Each source's share of the samples of the global batches before `step` (default: this loader's)."""
        counts = self.source.schedule.counts((self.step if step is None else step) * self.G)
        total = max(1, int(counts.sum()))
        return {n: int(c) / total for n, c in zip(self.source.names, counts)}

    def cursor(self):
        """The streams' positions after the batches built so far (None: random access, the step is all)."""
        return {i: r.position for i, r in self.streams.items()} or None

    def seek(self, step: int, positions) -> None:
        self.step = step
        for i, pos in positions.items():
            self.streams[int(i)].seek(0, pos)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.streams:
            state["streams"] = {str(i): list(r.position) for i, r in self.streams.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.streams and "streams" not in state:
            raise ValueError("data loader state holds no stream positions (saved without this data.mix)")
        self.seek(self.step, state.get("streams", {}))

    def close(self) -> None:
        """Nothing to stop here (`data.workers` has processes to stop)."""
