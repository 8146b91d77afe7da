"""Streaming text records (data.streaming: true): read and tokenized while training, never held whole in memory.

The global order is the files' order (data.paths, globs sorted), record by record: each record's `text_field`
is tokenized and ended by EOS, and the token stream is cut into windows of `seq_len + 1` tokens that start
`seq_len` apart, exactly the windows the in-memory source (`TokenStreamSource`) makes of the same records. Global
batch k is windows k*G .. k*G+G-1 of that stream; the stream restarts from the first file once it ends (a
tail shorter than a window is left out, as in memory). Nothing in it depends on the world size: every rank
reads the same stream and keeps its contiguous slice of each global batch, so global batch k is the same at any
world size and micro batch size. There is no shuffle: order the records when preparing the files.

The price of world-size independence: every data-parallel rank reads and tokenizes every record (with
data.num_workers = 1 that happens in a background process, ahead of the step).

Position: (epoch, file, record, token offset) of the next window's first token, in the loader's state_dict, so a
resume (at any world size) continues with exactly the next window. Resuming re-reads the records of the current
file up to `record` without tokenizing them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshforge.data import fingerprint
from meshforge.data.fingerprint import check_resume
from meshforge.data.loader import BatchGeometry
from meshforge.errors import DataError


class StreamingTextSource:
    """What a streaming loader reads: record files, their text field, the tokenizer, the window length."""

    streaming = True

    def __init__(self, paths: list[Path], tokenizer, text_field: str, seq_len: int, vocab_size: int):
        self.paths, self.tok, self.text_field = list(paths), tokenizer, text_field
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.name = f"{tokenizer.name}:stream:" + ",".join(str(p) for p in self.paths)
        self.inputs = {**fingerprint.files("data.paths", self.paths), **tokenizer.fingerprint(),
                       **fingerprint.settings(source="dataset", streaming=True, text_field=text_field,
                                              seq_len=seq_len)}

    def records(self, file: int, record: int):
        """(file, record, token ids + EOS) from that position on, to the end of the last file."""
        from meshforge.data.records import positioned_documents

        for fi, ri, text in positioned_documents(self.paths, self.text_field, file, record):
            ids = np.asarray(self.tok.encode(text) + [self.tok.eos_id], dtype=np.int64)
            if ids.max() >= self.vocab_size:
                raise DataError(f"data: token id {int(ids.max())} in {self.paths[fi]} record {ri} is outside "
                                f"model.vocab_size={self.vocab_size}")
            yield fi, ri, ids

    def digest(self) -> str:
        return fingerprint.digest(self.inputs)


class StreamingBatchLoader(BatchGeometry):
    """`ShardedBatchLoader`'s interface over a `StreamingTextSource`: batches in stream order, one after another."""

    def __init__(self, source: StreamingTextSource, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, allow_changed_inputs: bool = False):
        super().__init__(global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.source, self.allow_changed_inputs = source, allow_changed_inputs
        self.resume_note: str | None = None
        self.step = 0
        self.position = (0, 0, 0, 0)  # (epoch, file, record, token offset) of the next window's first token
        self._reader = None  # (records iterator, pending [(file, record, ids)]) positioned at self.position

    def _window(self) -> np.ndarray:
        """The next window of seq_len + 1 tokens; moves the position seq_len tokens on (the stream wraps)."""
        n, s = self.source.seq_len + 1, self.source.seq_len
        for attempt in range(2):
            epoch, file, record, offset = self.position
            if self._reader is None:
                self._reader = (self.source.records(file, record), [])
            it, pending = self._reader
            have = sum(len(ids) for _, _, ids in pending) - offset
            while have < n:
                nxt = next(it, None)
                if nxt is None:
                    break
                pending.append(nxt)
                have += len(nxt[2])
            if have >= n:
                parts, need, start = [], n, offset  # only the records the window covers
                for _, _, ids in pending:
                    parts.append(ids[start:start + need])
                    need, start = need - len(parts[-1]), 0
                    if not need:
                        break
                tokens = np.concatenate(parts)
                offset += s
                while offset >= len(pending[0][2]):  # drop the records the next window starts after
                    offset -= len(pending.pop(0)[2])
                    if not pending:  # (only if a window ends exactly where the record list does)
                        nxt = next(it, None)
                        if nxt is None:
                            break
                        pending.append(nxt)
                if pending:
                    self.position = (epoch, pending[0][0], pending[0][1], offset)
                else:  # stream exhausted right at the window's end: the next epoch starts
                    self.position, self._reader = (epoch + 1, 0, 0, 0), None
                return tokens
            if attempt or (file, record, offset) == (0, 0, 0):
                raise DataError(f"data: {self.source.name} holds fewer tokens than one sequence of "
                                f"training.seq_len+1 = {n}")
            self.position, self._reader = (epoch + 1, 0, 0, 0), None  # end of the data: the next epoch
        raise AssertionError("unreachable")

    def batch(self, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro batches of global batch k, which must be the next one of the stream."""
        if k != self.step:
            raise RuntimeError(f"a streaming loader reads batches in order: asked for {k}, next is {self.step}")
        seqs = np.stack([self._window() for _ in range(self.G)])
        self.step += 1
        mine = torch.from_numpy(seqs[self.local_slice()])
        return [(mine[i:i + self.m, :-1].contiguous(), mine[i:i + self.m, 1:].contiguous())
                for i in range(0, len(mine), self.m)]

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.batch(self.step)

    def cursor(self):
        """The stream position after the batches built so far (background workers hand it back with each batch)."""
        return self.position

    def seek(self, step: int, position) -> None:
        self.step, self.position, self._reader = step, tuple(position), None

    def state_dict(self) -> dict:
        return {"step": self.step, "position": list(self.position), "global_batch_size": self.G,
                "source": self.source.digest(), "inputs": dict(self.source.inputs)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch_size") != self.G:
            raise ValueError(f"data loader state was saved with global_batch_size={state.get('global_batch_size')!r} "
                             f"but this run has {self.G!r}; resume with the same data and batch settings")
        self.resume_note = check_resume(state, self.source.inputs, self.allow_changed_inputs)
        if "position" not in state:
            raise ValueError("data loader state holds no stream position (saved without data.streaming)")
        self.seek(int(state["step"]), state["position"])

    def close(self) -> None:
        """Nothing to stop here (`data.workers` has processes to stop)."""
