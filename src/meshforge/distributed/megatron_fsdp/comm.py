"""The collectives Megatron-FSDP issues, each counting the bytes it is handed (`CommCounter.bytes`).

Bytes are counted on the full-buffer side of each call: the output of an
all-gather, the input of a reduce-scatter, the tensor of an all-reduce. That is
the "volume" the ZeRO papers quote (ZeRO-3 per step: 2 x params all-gathered +
1 x grads reduce-scattered); the bytes on the wire per rank are (N-1)/N of it
for ring algorithms. With a group of size 1 no collective runs and nothing is
counted.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

# torch >= 2.13 names; the older ones are deprecated there
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    def __init__(self, group, world: int):
        self.group, self.world = group, world
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def _count(self, kind: str, t: torch.Tensor) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, kind: str = "all_gather"):
        if self.world == 1:
            out.copy_(inp)
            return None
        self._count(kind, out)
        return _all_gather(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, avg: bool, async_op: bool = False):
        if self.world == 1:
            out.copy_(inp)
            return None
        self._count("reduce_scatter", inp)
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        return _reduce_scatter(out, inp, op=op, group=self.group, async_op=async_op)

    def all_reduce(self, t: torch.Tensor, avg: bool, async_op: bool = False, kind: str = "all_reduce"):
        if self.world == 1:
            return None
        self._count(kind, t)
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        return dist.all_reduce(t, op=op, group=self.group, async_op=async_op)
