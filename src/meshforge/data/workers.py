"""Background loading: this rank's global batches built by worker processes ahead of the step (data.num_workers).

torchdata's `StatefulDataLoader` (as torchtitan uses) runs `ShardedBatchLoader.batch(k)` in `num_workers`
processes, each keeping `prefetch_factor` batches ready, and hands them back in order. The data is the loader's
own: batch k is a pure function of k (global batch k the same at any world size and micro batch size, this rank's
disjoint slice), so workers change when a batch is built, never which. Each item carries its k and the main
process checks it against the batches it has consumed, so a wrong order cannot pass silently.

Workers are forked on Linux (whatever Python's default start method), so an in-memory source is shared
copy-on-write instead of pickled into each worker; elsewhere the platform's default applies.

Position: `step` counts the batches the training loop has taken (not those prefetched). The checkpoint holds it
plus the `StatefulDataLoader` state; a resume with the same `num_workers` restores that state, any other resume
(another worker count, another world size, 0 workers) restarts the workers at `step`, which is the same batch.
"""

from __future__ import annotations

import signal
import sys
import warnings

import torch

from meshforge.errors import DataError


class _GlobalBatches(torch.utils.data.Dataset):
    """Map-style: item k = (k, this rank's micro batches of global batch k, the loader's cursor after it)."""

    def __init__(self, loader):
        self.loader = loader

    def __getitem__(self, k: int):
        # numpy arrays travel pickled through the worker's queue: for a step's few small arrays that is ~10x
        # faster than torch's shared-memory tensors (a file descriptor each; measured in the j15 note)
        try:
            batch = [tuple(t.numpy() for t in mb) for mb in self.loader.batch(k)]
        except DataError as err:  # bad data read in a worker stays one line (the data loader would wrap it)
            return k, err.problems, None
        return k, batch, self.loader.cursor()  # a stream's position after batch k travels back with it


def _ignore_interrupts(_worker_id: int) -> None:
    """Ctrl-C reaches the whole process group: the training process finishes its step and saves (it stops the
    workers itself), so the workers leave the signal to it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_is(item):
    """The worker's item unchanged (the default would turn numpy arrays into shared-memory tensors)."""
    return item


class _Steps:
    """The sampler: global batch numbers from `next` on, endless; stateful, so the data loader checkpoints it."""

    def __init__(self, start: int):
        self.next = start

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.next += 1
        return self.next - 1

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])


class BackgroundLoader:
    """`ShardedBatchLoader`'s interface (next_batch, state_dict, load_state_dict, accum_steps) with the batches
    built in worker processes. Workers start at the first `next_batch`, so a resume's state is loaded first."""

    def __init__(self, loader, num_workers: int, prefetch_factor: int):
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401
        except ImportError:
            raise DataError("data.num_workers > 0 needs torchdata: pip install 'meshforge[data]'") from None
        self.loader, self.num_workers, self.prefetch_factor = loader, num_workers, prefetch_factor
        self._dl = self._it = self._resume_state = None

    @property
    def accum_steps(self) -> int:
        return self.loader.accum_steps

    @property
    def step(self) -> int:
        return self.loader.step

    @property
    def resume_note(self) -> str | None:
        return self.loader.resume_note

    def _start(self) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API; nothing for a user to do
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self._dl = StatefulDataLoader(_GlobalBatches(self.loader), batch_size=None,
                                          sampler=_Steps(self.loader.step), num_workers=self.num_workers,
                                          prefetch_factor=self.prefetch_factor, collate_fn=_as_is,
                                          multiprocessing_context="fork" if sys.platform == "linux" else None,
                                          worker_init_fn=_ignore_interrupts)
            if self._resume_state is not None:
                self._dl.load_state_dict(self._resume_state)
                self._resume_state = None
            self._it = iter(self._dl)

    def next_batch(self) -> list[tuple[torch.Tensor, ...]]:
        if self._it is None:
            self._start()
        k, arrays, cursor = next(self._it)
        if arrays and isinstance(arrays[0], str):
            raise DataError(arrays)
        batch = [tuple(torch.from_numpy(a) for a in mb) for mb in arrays]
        if k != self.loader.step:  # the worker pipeline and the consumed count disagree: never train on it
            raise RuntimeError(f"background data loader returned global batch {k}, expected {self.loader.step}")
        if cursor is None:
            self.loader.step += 1
        else:  # a stream: the main process's loader takes the position the worker reached
            self.loader.seek(k + 1, cursor)
        return batch

    def state_dict(self) -> dict:
        state = self.loader.state_dict()
        if self._dl is not None:
            state["workers"] = {"num_workers": self.num_workers, "dataloader": self._dl.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self.close()
        workers = state.get("workers")
        if workers and workers["num_workers"] == self.num_workers:
            self._resume_state = workers["dataloader"]

    def close(self) -> None:
        """Stop the workers (they also stop with the process)."""
        self._it = self._dl = None


def background(loader, data_cfg):
    """The loader itself (data.num_workers = 0: batches built in the step), or its background version."""
    if not data_cfg.num_workers:
        return loader
    return BackgroundLoader(loader, data_cfg.num_workers, data_cfg.prefetch_factor)
