"""Activation memory of one transformer block per rank, context parallelism cp=1 vs cp=2 (and more).

What is measured: the bytes autograd keeps for backward during one block's forward (every tensor that reaches
`saved_tensors_hooks`, counted once per storage, parameters excluded), for a micro-batch of `--batch` sequences
of `--seq` tokens. cp=1 is the plain model in this process; cp=N runs N gloo processes (`meshforge.launch`),
each holding its load-balanced S/N tokens and the context-parallel attention in the model's attention slots
(all-gather K/V, recompute in backward). With cp=N the per-rank bytes should be 1/N of cp=1 (the issue asks: cp2
halved within 10%).

    python benchmarks/cp_activation_memory.py [--preset small] [--seq 1024] [--batch 1] [--cp 2 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def build_block(preset: str):
    from meshforge.config.schema import ModelConfig
    from meshforge.models import build_model, init_weights

    model = build_model(ModelConfig(preset=preset, n_layers=1))
    init_weights(model, 0)
    return model, model.layers["0"]


def saved_bytes(block, x: torch.Tensor, positions: torch.Tensor, args) -> int:
    from meshforge.models.llama import rope_cos_sin

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    cos, sin = rope_cos_sin(positions, args.hd, args.rope_theta)
    x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, cos, sin)
    out.sum().backward()  # the saved tensors are really used (and the cp collectives run in backward)
    return sum(seen.values())


def _inputs(args, batch: int, seq: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, seq, args.dim, generator=g)


def cp_rank_bytes(spec: dict) -> int:
    """Launch target: this rank's saved bytes with context-parallel attention over all ranks."""
    import torch.distributed as dist

    from meshforge.distributed.context_parallel import ContextParallelAttention, load_balanced_indices
    from meshforge.distributed.env import destroy, init_distributed
    from meshforge.models import contract_of, set_submodule

    info = init_distributed("cpu")
    model, block = build_block(spec["preset"])
    for slot in contract_of(model).attention_slots():
        set_submodule(model, slot, ContextParallelAttention(dist.group.WORLD, info.world_size, info.rank))
    idx = load_balanced_indices(spec["seq"], info.world_size, info.rank)
    x = _inputs(model.args, spec["batch"], spec["seq"]).index_select(1, idx)
    nbytes = saved_bytes(block, x, idx, model.args)
    destroy()
    return nbytes


def measure(preset: str, batch: int, seq: int, cps: list[int]) -> list[tuple[int, int, int]]:
    """[(cp, tokens per rank, max saved bytes per rank)], cp=1 first."""
    from meshforge.launch import launch

    torch.set_num_threads(1)
    model, block = build_block(preset)
    rows = [(1, batch * seq, saved_bytes(block, _inputs(model.args, batch, seq), torch.arange(seq), model.args))]
    for cp in cps:
        res = launch(f"{Path(__file__).resolve()}:cp_rank_bytes", {"preset": preset, "batch": batch, "seq": seq},
                     cp, timeout=600).check()
        rows.append((cp, batch * seq // cp, max(res.ranks)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cp", type=int, nargs="+", default=[2])
    a = ap.parse_args(argv)
    rows = measure(a.preset, a.batch, a.seq, a.cp)
    base = rows[0][2]
    print(f"activation memory of one {a.preset} block, micro-batch {a.batch} x {a.seq} tokens, fp32")
    print(f"{'cp':>4} {'tokens/rank':>12} {'saved MiB/rank':>15} {'vs cp=1':>8} {'ideal':>6}")
    for cp, tokens, nbytes in rows:
        print(f"{cp:>4} {tokens:>12} {nbytes / 2**20:>15.3f} {nbytes / base:>8.3f} {1 / cp:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
