"""Bytes per rank of parameters, gradients and optimizer state, and bytes handed to collectives per step.

For ddp, fsdp2 and megatron_fsdp x {no_shard, optim, optim_grads, optim_grads_params} at N ranks on CPU
(gloo), beside the theoretical values (fp32 everywhere, P = parameter count, 4 bytes each):

  strategy                 params at rest    grads held      optimizer (AdamW)  collectives per step
  ddp                      4P                4P              8P                 all-reduce 4P
  fsdp2                    4P/N              4P/N            8P/N               all-gather 2x4P + reduce-scatter 4P
  mfsdp no_shard           4P                4P              8P                 all-reduce 4P
  mfsdp optim              4P + 4P/N         4P              8P/N               all-reduce 4P + all-gather 4P
  mfsdp optim_grads        4P + 4P/N         4P/N            8P/N               reduce-scatter 4P + all-gather 4P
  mfsdp optim_grads_params 4P/N              4P/N            8P/N               all-gather 2x4P + reduce-scatter 4P

(fsdp2 and ZeRO-3 gather "2x" at most: the root unit and the last block are not re-gathered for backward,
so the measured all-gather is below the textbook figure; the table prints both.)

Measured, not computed: megatron_fsdp numbers come from its buffers (`strategy.memory_report()`) and its
collective wrapper (`strategy.comm_bytes`); ddp's from the parameters, `.grad`s and optimizer state, and a
counting DDP comm hook; fsdp2's from the local shards of its DTensors and counting wrappers around
`dist.all_gather_single` / `dist.reduce_scatter_single` / `dist.all_reduce`. Padding and AdamW's `step`
scalars make measured values a little above theory. Grads are measured after the last backward's sync,
before the optimizer step. Bytes passed to collectives: the full-buffer side (all-gather output, reduce-scatter
input, all-reduce tensor); a ring moves (N-1)/N of that per rank.

Usage: python benchmarks/memory_per_rank.py [--nproc 4] [--preset tiny] [--json out.json]
(it launches itself on N gloo processes with torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

STRATEGIES = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp2": ["distributed.strategy=fsdp2"],
    **{f"mfsdp_{m}": ["distributed.strategy=megatron_fsdp", f"distributed.data_parallel_sharding_strategy={m}"]
       for m in ("no_shard", "optim", "optim_grads", "optim_grads_params")},
}


def theory(name: str, P: int, N: int) -> dict[str, float]:
    """Theoretical bytes per rank (fp32) and collective volume per step."""
    b = 4 * P
    t = {
        "ddp": (b, b, 2 * b, {"all_reduce": b}),
        "fsdp2": (b / N, b / N, 2 * b / N, {"all_gather": 2 * b, "reduce_scatter": b}),
        "mfsdp_no_shard": (b, b, 2 * b, {"all_reduce": b}),
        "mfsdp_optim": (b + b / N, b, 2 * b / N, {"all_reduce": b, "all_gather": b}),
        "mfsdp_optim_grads": (b + b / N, b / N, 2 * b / N, {"reduce_scatter": b, "all_gather": b}),
        "mfsdp_optim_grads_params": (b / N, b / N, 2 * b / N, {"all_gather": 2 * b, "reduce_scatter": b}),
    }[name]
    return {"params": t[0], "grads": t[1], "optimizer": t[2], "comm": t[3]}


# ------------------------------------------------------------------------------------- worker
def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


class _PatchedCollectives:
    """Counts bytes handed to torch.distributed collectives (fsdp2), restoring them on exit."""

    def __init__(self, counter: Counter):
        self.counter = counter

    def __enter__(self):
        import torch.distributed as dist

        self.saved = {k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single", "all_reduce")
                      if hasattr(dist, k)}
        c = self.counter

        def ag(out, inp, *a, **k):
            c["all_gather"] += out.numel() * out.element_size()
            return self.saved["all_gather_single"](out, inp, *a, **k)

        def rs(*a, **k):
            inp = k.get("input", a[1] if len(a) > 1 else None)
            c["reduce_scatter"] += inp.numel() * inp.element_size()
            return self.saved["reduce_scatter_single"](*a, **k)

        def ar(t, *a, **k):
            c["all_reduce"] += t.numel() * t.element_size()
            return self.saved["all_reduce"](t, *a, **k)

        for k, f in (("all_gather_single", ag), ("reduce_scatter_single", rs), ("all_reduce", ar)):
            if k in self.saved:
                setattr(dist, k, f)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for k, f in self.saved.items():
            setattr(dist, k, f)


def _measure(name: str, overrides: list[str], preset: str, info) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from meshforge.config import load_config
    from meshforge.distributed.mesh import MeshContext
    from meshforge.testing.parity import base_overrides
    from meshforge.training.optim import build_optimizer
    from meshforge.training.trainer import build_parallel_model, seed_everything

    cfg = load_config(None, base_overrides(3) + [f"model.preset={preset}"] + overrides, world_size=info.world_size)
    seed_everything(cfg.run.seed)
    mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, "cpu")
    pm = build_parallel_model(cfg, mesh_ctx, info.device)
    opt = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer, info.device)
    strat = pm.strategy
    mf = strat.name == "megatron_fsdp"
    comm: Counter = Counter()
    if isinstance(pm.model, DistributedDataParallel):
        import torch.distributed as dist

        def hook(state, bucket):
            t = bucket.buffer()
            comm["all_reduce"] += t.numel() * t.element_size()
            fut = dist.all_reduce(t.div_(dist.get_world_size(state)), group=state, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        pm.model.register_comm_hook(mesh_ctx.group("dp"), hook)
    g = torch.Generator().manual_seed(1 + mesh_ctx.dp_rank)
    seq = cfg.training.seq_len
    n_micro = cfg.training.global_batch_size // (cfg.training.micro_batch_size * mesh_ctx.dp_size)
    out = {}
    for step in range(3):
        mbs = []
        for _ in range(n_micro):
            x = torch.randint(0, 256, (cfg.training.micro_batch_size, seq), generator=g)
            mbs.append((x, torch.roll(x, -1, 1)))
        measured = step == 2
        if measured:
            comm.clear()
            if mf:
                strat.reset_comm()
        ctx = _PatchedCollectives(comm) if (measured and strat.name == "fsdp2") else None
        if ctx:
            ctx.__enter__()
        pm.forward_backward(mbs)
        if measured:
            grads = strat.grad_bytes() if mf else sum(_local_bytes(p.grad) for p in pm.model.parameters())
        pm.clip_grad_norm_(1.0)
        opt.step()
        pm.after_optimizer_step()
        pm.zero_grad(opt)
        if ctx:
            ctx.__exit__(None, None, None)
    if mf:
        rep = strat.memory_report(opt)
        params, optim = rep["params_at_rest"], rep["optimizer_state"]
        comm = Counter({k: v for k, v in strat.comm_bytes.items() if k != "checkpoint"})
        out["gathered_peak"] = rep["gathered_peak"]
        out["largest_unit_bytes"] = rep["largest_unit_bytes"]
        out["grads_peak"] = rep["grads_peak"]
    else:
        params = sum(_local_bytes(p) for p in pm.model.parameters())
        optim = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    n_params = sum(p.numel() for p in pm.unwrapped_parts()[0].parameters()) if not mf else \
        strat.memory_report()["total_param_numel"]
    if strat.name == "fsdp2":  # DTensor shards: the global count
        n_params = sum(p.numel() for p in pm.model.parameters())
    out.update(params=params, grads=grads, optimizer=optim, comm=dict(comm), P=n_params)
    return out


def worker(args) -> None:
    import torch.distributed as dist

    from meshforge.distributed.env import init_distributed

    info = init_distributed("cpu", timeout_minutes=10)
    results = {}
    for name in args.strategies.split(","):
        r = _measure(name, STRATEGIES[name], args.preset, info)
        per_rank = [None] * info.world_size
        dist.all_gather_object(per_rank, r)
        results[name] = per_rank
    if info.rank == 0:
        Path(args.json).write_text(json.dumps(results))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------- launcher
def run(nproc: int = 4, preset: str = "tiny", strategies: list[str] | None = None, timeout: float = 900) -> dict:
    """Launch the worker on `nproc` gloo processes; {strategy: [per-rank dicts]}."""
    strategies = strategies or list(STRATEGIES)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mem.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), "--worker", "--json", str(out), "--preset", preset,
               "--strategies", ",".join(strategies)]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if not out.exists():
            raise RuntimeError(f"memory benchmark failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


def table(results: dict, nproc: int) -> str:
    kb = 1024
    lines = [f"bytes per rank (max over {nproc} ranks), KiB measured / theory",
             f"{'strategy':26s} {'params at rest':>20s} {'grads held':>20s} {'optimizer state':>20s}"]
    header = f"{'strategy':26s} {'all_gather':>20s} {'reduce_scatter':>20s} {'all_reduce':>20s} {'grad_norm':>10s}"
    comm_lines = ["bytes handed to collectives per step (rank 0), KiB measured / theory", header]
    for name, ranks in results.items():
        P = ranks[0]["P"]
        th = theory(name, P, nproc)
        cells = []
        for key in ("params", "grads", "optimizer"):
            m = max(r[key] for r in ranks)
            cells.append(f"{m / kb:9.1f} / {th[key] / kb:8.1f}")
        lines.append(f"{name:26s} " + " ".join(f"{c:>20s}" for c in cells))
        c0 = ranks[0]["comm"]
        cc = [f"{c0.get(k, 0) / kb:9.1f} / {th['comm'].get(k, 0) / kb:8.1f}"
              for k in ("all_gather", "reduce_scatter", "all_reduce")]
        comm_lines.append(f"{name:26s} " + " ".join(f"{c:>20s}" for c in cc) + f" {c0.get('grad_norm', 0):>10d}")
    extra = [f"{n}: gathered peak {max(r['gathered_peak'] for r in rs) / kb:.1f} KiB, largest unit "
             f"{rs[0]['largest_unit_bytes'] / kb:.1f} KiB, grads peak {max(r['grads_peak'] for r in rs) / kb:.1f} "
             f"KiB" for n, rs in results.items() if "gathered_peak" in rs[0]]
    n_params = results[next(iter(results))][0]["P"]
    return "\n".join(lines + [""] + comm_lines + [""] + extra + [f"P = {n_params} parameters"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json", default=None)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = run(args.nproc, args.preset, args.strategies.split(","))
    print(table(results, args.nproc))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
