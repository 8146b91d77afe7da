"""`meshforge plan CONFIG [overrides] --world-size N`: will it fit, how fast, which layout; no process started.

`--compare key=v1,v2` prints one row per value (repeat for all combinations); `--fit` searches layouts (tp, pp,
cp, strategy, virtual and uneven pipeline stages, checkpointing, micro batch, FP8) for the fastest that fit the
device memory, one reason per row, and says why the others were rejected; `--json` prints the plan as JSON.
`--calibrate RUN_DIR` fits the time model's efficiencies to a measured run (a bench output or a run directory)
and writes RUN_DIR/efficiency.json; `--efficiency FILE` plans with such a file. Every plan says which
efficiencies priced its step time and where they came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config (optional with --calibrate alone)")
    p.add_argument("overrides", nargs="*", default=[], help="key.path=value edits")
    p.add_argument("--world-size", type=int, default=None, help="number of devices (ranks)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (NVLink domain; default 8)")
    p.add_argument("--gpu", default=None,
                   help="h100 (default), h200, b200, a100, or NAME:PEAK_TFLOPS:MEMORY_GIB[:MEMORY_GBPS]; with "
                   "--efficiency, the file's device")
    p.add_argument("--link", default=None, metavar="nvlink=GBPS,fabric=GBPS",
                   help="override the device's link bandwidths (GB/s per device per direction)")
    p.add_argument("--mfu", type=float, default=None,
                   help="the one-number model: every matmul and attention FLOP at this fraction of the peak, "
                   "elementwise work free (default: the device's efficiencies, see --efficiency)")
    p.add_argument("--efficiency", default=None, metavar="FILE",
                   help="efficiencies (and the device) from `meshforge plan --calibrate` (default: the device's "
                   "stated datasheet defaults)")
    p.add_argument("--calibrate", default=None, metavar="RUN_DIR",
                   help="fit the efficiencies to a measured run (bench.json of `meshforge bench`, or a run's "
                   "metrics.jsonl) and write RUN_DIR/efficiency.json; with CONFIG, plan it with them")
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
    from meshforge.planning.headroom import headroom_from_arg

    if args.config is None and args.calibrate is None:
        return _fail("meshforge plan needs CONFIG (and --world-size N), or --calibrate RUN_DIR")
    if args.config is not None and args.world_size is None:
        return _fail("meshforge plan CONFIG needs --world-size N (the number of devices)")
    problem = arguments_problem(args)
    if problem:
        return _fail(problem)
    if args.mfu is not None and (args.efficiency or args.calibrate):
        return _fail("--mfu is the one-number model; --efficiency/--calibrate give measured efficiencies: use one")
    try:
        dev, eff = _device_and_efficiency(args)
        args.headroom_margins = headroom_from_arg(args.headroom)
    except (ValueError, MeshforgeError) as err:
        return _fail(getattr(err, "problems", None) or str(err))
    if args.config is None:
        return 0
    if args.world_size > 1 and min(dev.nvlink_gbps, dev.fabric_gbps) <= 0:
        return _fail(f"{args.efficiency or args.calibrate}: its device's links were not measured (a one-process "
                     "bench): calibrate on a bench with --nproc-per-node 2 or more to plan several devices")
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
            return _fit(cfgs[0][1], args, dev, eff)
        plans = [(c, _plan(cfg, args, dev, eff)) for c, cfg in cfgs]
    except MeshforgeError as err:
        return _fail(err.problems)
    if args.json:
        out = [dict(p.to_dict(), overrides=c) for c, p in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        return 0
    if len(plans) == 1:
        _print_plan(plans[0][1])
    else:
        _print_compare(plans)
    return 0


MAX_WORLD = 2**20  # 1,048,576 devices: beyond any job built so far by two orders of magnitude


def arguments_problem(args) -> str | None:
    """One line when --world-size, --gpus-per-node or --mfu are out of range (None when they are fine)."""
    if args.config is not None and not 1 <= args.world_size <= MAX_WORLD:
        return (f"--world-size={args.world_size}: give the number of devices, 1 to {MAX_WORLD:,}"
                if args.world_size < 1 else
                f"--world-size={args.world_size:,} is beyond any job meshforge plans (at most {MAX_WORLD:,} devices)")
    if args.gpus_per_node < 1:
        return f"--gpus-per-node={args.gpus_per_node} must be >= 1"
    if args.mfu is not None and not 0 < args.mfu <= 1:
        return f"--mfu={args.mfu} must be in (0, 1]"
    return None


def _device_and_efficiency(args):
    """(device, efficiencies) the plan prices with: --calibrate's fit, --efficiency's file, --mfu's one number, or
    the device's stated defaults; --gpu and --link adjust the device (a file's device must be the one named)."""
    from meshforge.planning import calibrate
    from meshforge.planning.hardware import default_efficiency, device_from_arg, flat_efficiency, with_links

    if args.calibrate:
        dev, eff = _calibrate(args)
    elif args.efficiency:
        dev, eff = calibrate.load(args.efficiency)
    else:
        dev = device_from_arg(args.gpu or "h100")
        eff = flat_efficiency(args.mfu) if args.mfu is not None else default_efficiency(dev)
    if (args.calibrate or args.efficiency) and args.gpu and device_from_arg(args.gpu).name != dev.name:
        raise ValueError(f"--gpu {args.gpu}: the efficiencies were measured on {dev.name}; plan other hardware "
                         "without --efficiency (or calibrate on it)")
    return with_links(dev, args.link), eff


def _calibrate(args):
    """Fit, save and print the calibration of args.calibrate."""
    from meshforge.planning import calibrate
    from meshforge.planning.hardware import default_efficiency, device_from_arg

    measured, profile = calibrate.read_run(args.calibrate)
    if profile is not None:
        dev, base = calibrate.device_from_profile(profile, args.gpus_per_node)
    elif measured[0].device == "cpu":
        raise ValueError(f"--calibrate {args.calibrate}: a CPU run needs the device measured: rerun `meshforge bench "
                         "... --profile-device` (a CPU core has no datasheet peak)")
    else:
        dev = device_from_arg(args.gpu) if args.gpu else calibrate.datasheet_device(measured[0].device)
        base = default_efficiency(dev)
    eff = calibrate.calibrate(measured, dev, base, args.gpus_per_node, str(args.calibrate), profile is not None)
    path = calibrate.save(f"{args.calibrate}/{calibrate.EFFICIENCY_FILE}", dev, eff)
    print(f"calibration on {dev.name} ({dev.peak_tflops:.4g} TFLOP/s peak, {dev.mem_gbps:.4g} GB/s memory, "
          f"links {dev.nvlink_gbps:.3g}/{dev.fabric_gbps:.3g} GB/s):")
    print(f"{'layout':44s} {'N':>4} {'clock':>6} {'measured s':>11} {'fitted s':>9} {'error':>7}")
    for r in eff.fit["rows"]:
        print(f"{r['name'][:44]:44s} {r['world_size']:>4} {r['clock']:>6} {r['measured_s']:>11.4f} "
              f"{r['fitted_s']:>9.4f} {100 * (r['fitted_s'] / r['measured_s'] - 1):>+6.1f}%")
    print(f"efficiencies: {eff.describe()}")
    print(f"wrote {path} (plan with --efficiency {path})")
    return dev, dataclasses.replace(eff, source=f"{eff.source} [file {path}]")


def _plan(cfg, args, dev, eff):
    from meshforge.planning.plan import plan

    return plan(cfg, args.world_size, dev, args.gpus_per_node, efficiency=eff,
                headroom=getattr(args, "headroom_margins", None))


def _print_plan(p) -> None:
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
    t = p.time
    parts = ", ".join(f"{k} {v:.3f}" for k, v in t.parts.items() if v)
    print(f"\ncompute {p.compute_s:.3f} s on the slowest rank ({parts}; {p.flops_per_token / 1e9:.2f} GFLOP/token), "
          f"communication {p.comm_s:.3f} s ({t.exposed_s:.3f} s exposed), pipeline bubble {100 * p.bubble:.1f}% "
          f"({t.idle_s:.3f} s idle)")
    print(f"step {p.step_s:.3f} s, {p.tokens_per_s:,.0f} tokens/s, {p.tokens_per_s / p.world_size:,.0f} tokens/s "
          f"per device, MFU {100 * p.mfu:.1f}%")
    print(f"efficiencies: {p.efficiency.describe()}")
    for note in p.notes:
        print(f"note: {note}")


def _print_compare(plans) -> None:
    print(f"efficiencies: {plans[0][1].efficiency.describe()}")
    for note in dict.fromkeys(n for _c, p in plans for n in p.notes):
        print(f"note: {note}")
    print(f"{'configuration':40s} {'peak':>11} {'fits':>5} {'step s':>8} {'tokens/s':>12} {'MFU %':>6} "
          f"{'comm GB/step':>13}")
    for c, p in plans:
        name = " ".join(c) or "(base)"
        print(f"{name:40s} {_gb(p.peak_rank.peak):>11} {'yes' if p.fits else 'no':>5} {p.step_s:>8.3f} "
              f"{p.tokens_per_s:>12,.0f} {100 * p.mfu:>6.1f} {sum(p.comm.values()) / GB:>13.2f}")


def _fit(cfg, args, dev, eff) -> int:
    from meshforge.planning.fit import search

    fits, rejected, slower = search(cfg, args.world_size, dev, args.gpus_per_node, efficiency=eff)
    if args.json:
        print(json.dumps({"fits": [dict(f.plan.to_dict(), choice=f.choice.label(args.world_size), reason=f.reason)
                                   for f in fits],
                          "rejected": [{"choice": c, "why": w} for c, w in rejected], "slower_fitting": slower},
                         indent=1))
        return 0 if fits else 1
    print(f"efficiencies: {eff.describe()}")
    print(f"{'#':>2} {'layout':64s} {'peak':>10} {'step s':>8} {'tokens/s':>12} {'MFU %':>6}")
    for i, f in enumerate(fits):
        p = f.plan
        print(f"{i + 1:>2} {f.choice.label(args.world_size):64s} {_gb(p.peak_rank.peak):>10} {p.step_s:>8.3f} "
              f"{p.tokens_per_s:>12,.0f} {100 * p.mfu:>6.1f}")
        print(f"   {f.reason}")
    reasons: dict[str, int] = {}
    for _c, why in rejected:
        reasons[why] = reasons.get(why, 0) + 1
    print(f"\nthe {len(fits)} fastest layouts that fit; {slower} more fit but are slower; {len(rejected)} rejected:")
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:4d} x {why}")
    for note in dict.fromkeys(n for f in fits for n in f.plan.notes):
        print(f"note: {note}")
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
