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
(it runs `measure_job` on N gloo processes through `meshforge.launch`; the tests run the same job inside their
shared launch).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

STRATEGIES = {
    "ddp": ["distributed.strategy=ddp"],
    "fsdp2": ["distributed.strategy=fsdp2"],
    **{f"mfsdp_{m}": ["distributed.strategy=megatron_fsdp", f"distributed.data_parallel_sharding_strategy={m}"]
       for m in ("no_shard", "optim", "optim_grads", "optim_grads_params")},
}


def theory(name: str, P: int, N: int) -> dict:
    """Bytes per rank (fp32, AdamW) of params, grads, optimizer, and collective volume per step, for the
    configurations above at N ranks: the textbook table of the module docstring (the exact per-rank plan, with
    padding and scalars, is `meshforge plan`)."""
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
    from meshforge.testing.parity import base_overrides
    from meshforge.training.trainer import Trainer

    cfg = load_config(None, base_overrides(3) + [f"model.preset={preset}"] + overrides, world_size=info.world_size)
    trainer = Trainer.build(cfg, info)
    pm, opt, mesh_ctx = trainer.pm, trainer.optimizer, trainer.mesh_ctx
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
    out: dict = {}
    for _ in range(2):  # warm-up steps: optimizer state exists from the first one
        trainer.train_step()
    comm.clear()
    if mf:
        strat.reset_comm()
    grads = {}

    def clock(part: str) -> None:  # grads after the last backward's sync, before the optimizer step
        if part == "forward_backward":
            grads["bytes"] = strat.grad_bytes() if mf else sum(_local_bytes(p.grad) for p in pm.model.parameters())

    if strat.name == "fsdp2":
        with _PatchedCollectives(comm):
            trainer.train_step(clock)
    else:
        trainer.train_step(clock)
    if mf:
        rep = strat.memory_report(opt)
        params, optim = rep["params_at_rest"], rep["optimizer_state"]
        comm = Counter({k: v for k, v in strat.comm_bytes.items() if k != "checkpoint"})
        out["gathered_peak"] = rep["gathered_peak"]
        out["largest_unit_bytes"] = rep["largest_unit_bytes"]
        out["grads_peak"] = rep["grads_peak"]
        n_params = rep["total_param_numel"]
    else:
        params = sum(_local_bytes(p) for p in pm.model.parameters())
        optim = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        n_params = sum(p.numel() for p in pm.model.parameters())  # DTensors count their global size
    out.update(params=params, grads=grads["bytes"], optimizer=optim, comm=dict(comm), P=n_params)
    return out


def measure_job(spec: dict, info) -> dict:
    """Job target (`meshforge.testing.group`): {strategy: [per-rank dicts]} for spec's strategies."""
    import torch.distributed as dist

    results = {}
    for name in spec["strategies"]:
        r = _measure(name, STRATEGIES[name], spec["preset"], info)
        per_rank = [None] * info.world_size
        dist.all_gather_object(per_rank, r)
        results[name] = per_rank
    return results


def run(nproc: int = 4, preset: str = "tiny", strategies: list[str] | None = None, timeout: float = 900) -> dict:
    """Run `measure_job` on `nproc` gloo processes; {strategy: [per-rank dicts]}."""
    from meshforge.testing.group import Job, launch_jobs

    spec = {"preset": preset, "strategies": strategies or list(STRATEGIES)}
    out = launch_jobs([Job("memory", f"{Path(__file__).resolve()}:measure_job", spec, nproc)], nproc, timeout)
    if "error" in out["memory"]:
        raise RuntimeError(out["memory"]["error"])
    return out["memory"]["value"]


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
    args = ap.parse_args(argv)
    results = run(args.nproc, args.preset, args.strategies.split(","))
    print(table(results, args.nproc))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
