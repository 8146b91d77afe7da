"""A stateful, sharded, resumable loader of global batches.

Global batch k is always the same `global_batch_size` samples, in the same order,
whatever the world size and micro batch size: sample positions k*G .. k*G+G-1 of
a seeded per-epoch permutation. Data-parallel rank r takes the contiguous slice
[r*G/D, (r+1)*G/D) of it and splits that into micro batches. The only state is k,
so `load_state_dict` resumes with exactly the next batch; the state also holds the
data's fingerprint, and a resume onto changed data is refused (`fingerprint.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from meshforge.data.fingerprint import check_resume


class BatchGeometry:
    """A global batch of G sequences, data-parallel rank r's contiguous slice [r*G/D, (r+1)*G/D) of it, split
    into micro batches of m: the sizes every loader checks and shares."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp_size = "
                             f"{micro_batch_size}*{dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        self.G, self.m, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size

    @property
    def accum_steps(self) -> int:
        return self.G // (self.m * self.dp_size)

    def local_slice(self) -> slice:
        """This rank's positions in the global batch."""
        local = self.G // self.dp_size
        return slice(self.dp_rank * local, (self.dp_rank + 1) * local)


class ShardedBatchLoader(BatchGeometry):
    def __init__(self, source, global_batch_size: int, micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, allow_changed_inputs: bool = False):
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.source, self.seed, self.shuffle = source, seed, shuffle
        self.allow_changed_inputs = allow_changed_inputs
        self.resume_note: str | None = None  # set by a resume onto changed data that was allowed
        self.step = 0
        self._perm_epoch, self._perm = -1, None

    def _index(self, position: int) -> int:
        n = self.source.num_samples
        if not self.shuffle or n >= 2**32:
            return position
        epoch, offset = divmod(position, n)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[offset])

    def global_batch_indices(self, k: int) -> list[int]:
        return [self._index(k * self.G + j) for j in range(self.G)]

    def next_batch(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro batches of the next global batch (see `batch`)."""
        out = self.batch(self.step)
        self.step += 1
        return out

    def batch(self, k: int) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro batches of global batch k, as (inputs, labels) int64 tensors (plus document ids for
        packed sequences): a pure function of k, so background workers (`data.workers`) can build any of them."""
        mine = self.global_batch_indices(k)[self.local_slice()]
        out = []
        for i in range(0, len(mine), self.m):
            if hasattr(self.source, "batch"):  # examples with label masks (SFT): (x, y[, document ids])
                arrays = self.source.batch(mine[i:i + self.m])
                out.append(tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
                continue
            seqs = torch.from_numpy(self.source.samples(mine[i:i + self.m]))
            out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "global_batch_size": self.G, "source": self.source.digest(),
                "inputs": dict(self.source.inputs)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step; the batch settings must match, and the data too (`fingerprint.py`)."""
        for key, mine in (("seed", self.seed), ("global_batch_size", self.G)):
            if key in state and state[key] != mine:
                raise ValueError(f"data loader state was saved with {key}={state[key]!r} but this run has {mine!r}; "
                                 "resume with the same data and batch settings")
        self.resume_note = check_resume(state, self.source.inputs, self.allow_changed_inputs)
        self.step = int(state["step"])

    def cursor(self) -> None:
        """Random access: the step is the whole position (a streaming loader has more, see `data.streaming`)."""
        return None

    def close(self) -> None:
        """Nothing to stop: batches are built in the step (`data.workers` has processes to stop)."""
