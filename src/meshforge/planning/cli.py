"""`meshforge plan CONFIG [overrides] --world-size N`: will it fit, how fast, which layout; no process started.

`--compare key=v1,v2` prints one row per value (repeat for all combinations); `--fit` searches tp, pp, cp,
strategy, activation checkpointing and micro batch for the fastest layouts that fit the device memory and
says why the others were rejected; `--json` prints the plan as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config")
    p.add_argument("overrides", nargs="*", help="key.path=value edits")
    p.add_argument("--world-size", type=int, required=True, help="number of devices (ranks)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (NVLink domain; default 8)")
    p.add_argument("--gpu", default="h100", help="h100, h200, b200, a100, or NAME:PEAK_TFLOPS:MEMORY_GIB")
    p.add_argument("--link", default=None, metavar="nvlink=GBPS,fabric=GBPS",
                   help="override the device's link bandwidths (GB/s per device per direction)")
    p.add_argument("--mfu", type=float, default=0.4,
                   help="assumed efficiency of the compute while it runs (model FLOPs / device peak; 0.4); the "
                   "printed MFU adds recomputation, the pipeline bubble and exposed communication")
    p.add_argument("--compare", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="one plan per value (repeat the flag for all combinations); one table")
    p.add_argument("--headroom", default=None, metavar="none|KEY=VALUE,...",
                   help="margins the verdict adds to the tensors' peak (fragmentation=0.1, context_gib=1, "
                   "nccl_mib=256 per communicator, compile_gib=0.5, fp8_gib=0.25; planning/headroom.py says why); "
                   "none: the tensors alone")
    p.add_argument("--fit", action="store_true", help="search layouts that fit and print the fastest few")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _fail(lines) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        print(f"error: {line}", file=sys.stderr)
    return 2


def _gb(n: float) -> str:
    """Bytes with a unit that keeps tiny CPU models readable (GB, MB or KB)."""
    for unit, scale in (("GB", GB), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.2f} KB"


def run(args) -> int:
    from meshforge.config import ConfigError, load_config
    from meshforge.errors import MeshforgeError
    from meshforge.planning.hardware import device_from_arg, with_links
    from meshforge.planning.headroom import headroom_from_arg

    problem = arguments_problem(args)
    if problem:
        return _fail(problem)
    try:
        dev = with_links(device_from_arg(args.gpu), args.link)
        args.headroom_margins = headroom_from_arg(args.headroom)
    except ValueError as err:
        return _fail(str(err))
    sweeps = []
    for item in args.compare:
        key, _, vals = item.partition("=")
        if not key or not vals:
            return _fail(f"--compare {item!r}: write KEY=V1,V2,...")
        sweeps.append([f"{key}={v}" for v in vals.split(",")])
    combos = [list(c) for c in itertools.product(*sweeps)] if sweeps else [[]]
    try:
        cfgs = [(c, load_config(args.config, args.overrides + c, world_size=args.world_size)) for c in combos]
    except ConfigError as err:
        return _fail(err.problems)
    try:
        if args.fit:
            return _fit(cfgs[0][1], args, dev)
        plans = [(c, _plan(cfg, args, dev)) for c, cfg in cfgs]
    except MeshforgeError as err:
        return _fail(err.problems)
    if args.json:
        out = [dict(p.to_dict(), overrides=c) for c, p in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        return 0
    if len(plans) == 1:
        _print_plan(plans[0][1], args)
    else:
        _print_compare(plans)
    return 0


MAX_WORLD = 2**20  # 1,048,576 devices: beyond any job built so far by two orders of magnitude


def arguments_problem(args) -> str | None:
    """One line when --world-size, --gpus-per-node or --mfu are out of range (None when they are fine)."""
    if not 1 <= args.world_size <= MAX_WORLD:
        return (f"--world-size={args.world_size}: give the number of devices, 1 to {MAX_WORLD:,}"
                if args.world_size < 1 else
                f"--world-size={args.world_size:,} is beyond any job meshforge plans (at most {MAX_WORLD:,} devices)")
    if args.gpus_per_node < 1 or not 0 < args.mfu <= 1:
        return f"--gpus-per-node={args.gpus_per_node} must be >= 1 and --mfu={args.mfu} in (0, 1]"
    return None


def _plan(cfg, args, dev):
    from meshforge.planning.plan import plan

    return plan(cfg, args.world_size, dev, args.gpus_per_node, args.mfu,
                headroom=getattr(args, "headroom_margins", None))


def _print_plan(p, args) -> None:
    lay = p.layout
    count = f"{p.n_params / 1e9:.3f}B" if p.n_params >= 1e8 else f"{p.n_params / 1e6:.3f}M"
    print(f"plan: {count} parameters, strategy {p.strategy}"
          f"{f' ({p.mode})' if p.mode else ''}, world {p.world_size} = pp {lay.pp} x dp_replicate "
          f"{lay.dp_replicate} x dp_shard {lay.dp_shard} x cp {lay.cp} x tp {lay.tp}"
          f"{f' (ep {lay.ep})' if lay.ep > 1 else ''}, on {p.device.name} ({p.device.memory_gib:g} GiB, "
          f"{p.device.peak_tflops:g} TFLOP/s bf16)")
    print("\nmemory per rank")
    print(f"{'rank':>6} {'params':>11} {'grads':>11} {'optim':>11} {'buffers':>11} {'acts/mb':>11} {'in-flight':>9} "
          f"{'recompute':>11} {'peak':>11}")
    shown, seen = [], set()
    for r in sorted(p.ranks, key=lambda r: -r.peak):
        key = (r.parts.total, r.activations["total"], r.in_flight)
        if key not in seen:
            seen.add(key)
            shown.append(r)
    for r in shown[:8]:
        print(f"{r.rank:>6} {_gb(r.parts.params):>11} {_gb(r.parts.grads):>11} {_gb(r.parts.optimizer):>11} "
              f"{_gb(r.parts.buffers):>11} {_gb(r.activations['total']):>11} {r.in_flight:>9} "
              f"{_gb(r.activations['recompute']):>11} {_gb(r.peak):>11}")
    pr = p.peak_rank
    verdict = "fits" if p.fits else "DOES NOT FIT"
    margins = ", ".join(f"{k} {_gb(v)}" for k, v in p.headroom.items() if v)
    print(f"peak {_gb(pr.peak)} on rank {pr.rank}; with headroom ({margins or 'none'}) {_gb(p.required_bytes)} "
          f"of {p.device.memory_gib:g} GiB: {verdict}" + (f"; host (CPU offload) {_gb(pr.parts.host)}"
                                                          if pr.parts.host else ""))
    print("\ncommunication per step (rank 0, full-buffer bytes)")
    for (axis, kind), n in sorted(p.comm.items(), key=lambda kv: -kv[1]):
        print(f"  {axis:>12} {kind:<26} {_gb(n):>11}")
    print(f"\ncompute {p.compute_s:.3f} s at MFU {args.mfu:g} ({p.flops_per_token / 1e9:.2f} GFLOP/token), "
          f"communication {p.comm_s:.3f} s, pipeline bubble {100 * p.bubble:.1f}%")
    print(f"step {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, {p.tokens_per_s / p.world_size:,.0f} tokens/s "
          f"per device, MFU {100 * p.mfu:.1f}%")
    for note in p.notes:
        print(f"note: {note}")


def _print_compare(plans) -> None:
    for note in dict.fromkeys(n for _c, p in plans for n in p.notes):
        print(f"note: {note}")
    print(f"{'configuration':40s} {'peak':>11} {'fits':>5} {'step s':>8} {'tokens/s':>12} {'MFU %':>6} "
          f"{'comm GB/step':>13}")
    for c, p in plans:
        name = " ".join(c) or "(base)"
        print(f"{name:40s} {_gb(p.peak_rank.peak):>11} {'yes' if p.fits else 'no':>5} {p.step_s:>8.3f} "
              f"{p.tokens_per_s:>12,.0f} {100 * p.mfu:>6.1f} {sum(p.comm.values()) / GB:>13.2f}")


def _fit(cfg, args, dev) -> int:
    from meshforge.planning.fit import search

    fits, rejected, slower = search(cfg, args.world_size, dev, args.gpus_per_node, args.mfu)
    if args.json:
        print(json.dumps({"fits": [dict(p.to_dict(), choice=c) for c, p in fits],
                          "rejected": [{"choice": c, "why": w} for c, w in rejected], "slower_fitting": slower},
                         indent=1))
        return 0 if fits else 1
    print(f"{'layout':58s} {'peak':>11} {'step s':>8} {'tokens/s':>12} {'MFU %':>6}")
    for c, p in fits:
        print(f"{c:58s} {_gb(p.peak_rank.peak):>11} {p.step_s:>8.3f} {p.tokens_per_s:>12,.0f} {100 * p.mfu:>6.1f}")
    reasons: dict[str, int] = {}
    for _c, why in rejected:
        reasons[why] = reasons.get(why, 0) + 1
    print(f"\nthe {len(fits)} fastest layouts that fit; {slower} more fit but are slower; {len(rejected)} rejected:")
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:4d} x {why}")
    if not fits:
        print("error: no searched layout fits the device memory", file=sys.stderr)
        return 1
    return 0


def memory_warning(cfg, world_size: int, gpu: str = "h100") -> str | None:
    """For `meshforge validate`: a warning when the plan's peak exceeds the device memory (None when it fits or
    the run is on CPU, where the host's memory is not planned)."""
    from meshforge.planning.plan import plan
    from meshforge.planning.hardware import device_from_arg

    if cfg.training.device == "cpu":
        return None
    dev = device_from_arg(gpu)
    p = plan(cfg, world_size, dev)
    if p.fits:
        return None
    pr = p.peak_rank
    return (f"the plan's peak memory {pr.peak / GB:.1f} GB on rank {pr.rank} exceeds a {dev.name}'s "
            f"{dev.memory_gib:g} GiB: see `meshforge plan CONFIG --world-size {world_size} --fit` for layouts that fit")
