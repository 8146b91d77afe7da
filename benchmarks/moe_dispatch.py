"""MoE expert-parallel dispatch: tokens per expert per rank, and all-to-all bytes per step beside the expected.

Runs a few real training steps (the trainer, synthetic data) of an MoE preset with expert parallelism on N
gloo processes and reads what the all-to-all dispatchers counted (`AllToAllDispatcher.stats`): the rows
each rank sent in every all-to-all (forward dispatch + combine, backward of both, and the recompute under
activation checkpointing), from the split sizes actually passed to the collectives.

Expected volume per rank and step, per MoE layer: the rank's token copies c = local tokens x top_k
(local tokens = global_batch / dp x seq_len) of width dim go out (dispatch) and the same number of rows
come back in the combine. Across the ep group the combine sends exactly what the dispatch received, so
forward bytes summed over ranks = 2 x sum(c) x dim x bytes; backward is the same again (and the
recompute once more with AC). With balanced routing each rank sends 2c rows forward; the part leaving
the rank is (ep-1)/ep of it. The per-rank measured value deviates from that by the routing imbalance,
the sum over ranks matches it exactly.

    python benchmarks/moe_dispatch.py --world 4 --ep 4 [--steps 5] [--ac] [override ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="processes to launch")
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--preset", default="tiny_moe")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--ac", action="store_true", help="activation checkpointing (adds the recompute's traffic)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    return p.parse_args(argv)


def measure(spec: dict) -> dict:
    """Launch target: train, then gather every rank's dispatcher counters (rank 0's value is used)."""
    import torch
    import torch.distributed as dist

    from meshforge.config import load_config
    from meshforge.distributed.env import destroy, init_distributed
    from meshforge.distributed.expert_parallel import dispatch_stats
    from meshforge.training.trainer import train

    info = init_distributed("cpu", timeout_minutes=5)
    ov = [f"model.preset={spec['preset']}", "data.source=synthetic", f"training.max_steps={spec['steps']}",
          f"training.seq_len={spec['seq']}", f"training.global_batch_size={spec['global_batch']}",
          f"training.micro_batch_size={spec['global_batch'] // info.world_size}", "training.device=cpu",
          "training.precision=fp32", "logging.progress=none", "logging.jsonl=false", "checkpoint.resume=none",
          f"distributed.ep_size={spec['ep']}", "run.output_dir=/tmp/meshforge_moe_bench"]
    if spec["ac"]:
        ov.append("distributed.activation_checkpointing=full")
    res = train(load_config(None, ov + spec["overrides"], world_size=info.world_size), info)
    pm = res.parallel_model
    mine = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for s in dispatch_stats(pm.unwrapped_parts()[0])]
    everyone: list = [None] * info.world_size
    dist.all_gather_object(everyone, {"rank": info.rank, "ep_rank": pm.mesh_ctx.ep_rank, "layers": mine})
    m = pm.mesh_ctx
    sizes = {"world_size": m.world_size, "dp_size": m.dp_size, "ep": m.size("ep"), "ep_shard": m.size("ep_shard")}
    args = pm.unwrapped_parts()[0].args
    destroy()
    return {"everyone": everyone, "sizes": sizes, "model": {k: getattr(args, k) for k in
                                                               ("n_experts", "top_k", "dim", "n_layers")}}


def report(args, a, sizes: dict, everyone) -> None:
    steps, ep, el = args.steps, args.ep, a.n_experts // args.ep
    elt = 4  # fp32 activations
    local_tokens = args.global_batch // sizes["dp_size"] * args.seq
    copies = local_tokens * a.top_k
    row = a.dim * elt
    phases = ("forward", "backward") + (("recompute",) if args.ac else ())
    exp_rank = {ph: a.n_layers * 2 * copies * row for ph in phases}  # balanced routing, per rank and step
    print(f"MoE dispatch: preset={args.preset} world={sizes['world_size']} ep={ep} ep_shard="
          f"{sizes['ep_shard']} experts={a.n_experts} ({el}/rank) top_k={a.top_k} dim={a.dim} "
          f"layers={a.n_layers} local tokens/step={local_tokens} steps={steps}{' AC' if args.ac else ''}")
    print("\ntokens per expert per rank and step (token copies each rank's experts computed, summed over layers)")
    print(f"{'rank':>4} {'ep':>3}  " + " ".join(f"{'local' + str(j):>7}" for j in range(el)) + "   [global expert ids]")
    for r in everyone:
        tok = [sum(layer["tokens_per_local_expert"][j] for layer in r["layers"]) / steps for j in range(el)]
        ids = " ".join(f"e{r['ep_rank'] * el + j}" for j in range(el))
        print(f"{r['rank']:>4} {r['ep_rank']:>3}  " + " ".join(f"{t:>7.1f}" for t in tok) + f"   [{ids}]")
    balanced = copies * sizes["ep"] / a.n_experts * a.n_layers
    print(f"balanced routing would give {balanced:.1f} per expert per rank\n")
    print("all-to-all bytes per rank and step (token rows; counts exchange not included)")
    print(f"{'rank':>4} " + " ".join(f"{ph + ' total':>16} {ph + ' remote':>17}" for ph in phases))
    totals = {ph: 0 for ph in phases}
    for r in everyone:
        cells = []
        for ph in phases:
            t = sum(layer[f"{ph}_bytes"] for layer in r["layers"]) / steps
            rem = sum(layer[f"{ph}_bytes_remote"] for layer in r["layers"]) / steps
            totals[ph] += t
            cells.append(f"{t:>16,.0f} {rem:>17,.0f}")
        print(f"{r['rank']:>4} " + " ".join(cells))
    print(f"{'exp.':>4} " + " ".join(f"{exp_rank[ph]:>16,.0f} {exp_rank[ph] * (ep - 1) / ep:>17,.0f}" for ph in phases)
          + "   (balanced routing)")
    n = sizes["world_size"]
    for ph in phases:
        want = n * exp_rank[ph]
        print(f"sum over ranks, {ph}: measured {totals[ph]:,.0f} B, expected {want:,.0f} B "
              f"({'exact' if abs(totals[ph] - want) < 1 else f'diff {totals[ph] - want:+,.0f}'})")


def main(argv=None) -> int:
    from meshforge.launch import launch

    args = parse(argv)
    spec = {"preset": args.preset, "steps": args.steps, "seq": args.seq, "global_batch": args.global_batch,
            "ep": args.ep, "ac": args.ac, "overrides": list(args.overrides)}
    out = launch(f"{Path(__file__).resolve()}:measure", spec, args.world, timeout=1800).check().value
    report(args, SimpleNamespace(**out["model"]), out["sizes"], out["everyone"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
