"""`meshforge plan CONFIG [overrides] --world-size N [--trace [--ranks 0,last]]`: the planner's command, and the
scale trace beside it.

Without --trace this is `planning/cli.py` (process-free, no torch import). With it, each chosen rank is traced
in its own process (`worker.py`) after its cost is estimated (`estimate.py`; over `--trace-limit-s` CPU seconds
or `--trace-limit-gb` of memory it is refused with the estimate), and the plan is printed beside the trace:
state bytes, peak memory, collective bytes per mesh axis.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshforge.planning import cli as planning_cli

GB = 1e9


def add_arguments(p: argparse.ArgumentParser) -> None:
    planning_cli.add_arguments(p)
    p.add_argument("--trace", action="store_true",
                   help="run one real training step of the chosen ranks in this CPU (fake process group, fake "
                   "tensors) and print the plan beside what it measured")
    p.add_argument("--ranks", default="0,last", metavar="R,R,...",
                   help="ranks to trace: integers, first, last (default 0,last)")
    p.add_argument("--trace-limit-s", type=float, default=120.0, metavar="S",
                   help="refuse a rank whose trace is estimated to need more CPU seconds (default 120)")
    p.add_argument("--trace-limit-gb", type=float, default=8.0, metavar="GB",
                   help="refuse a rank whose trace is estimated to need more memory (default 8)")


def run(args) -> int:
    if not args.trace:
        return planning_cli.run(args)
    return _trace(args)


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """`0,last` -> [0, world_size - 1]; ValueError (one line) for anything but ranks of this world."""
    out = []
    for item in spec.split(","):
        item = item.strip().lower()
        value = {"first": 0, "last": world_size - 1}.get(item)
        if value is None:
            try:
                value = int(item)
            except ValueError:
                value = -1
        if not 0 <= value < world_size:
            raise ValueError(f"--ranks {spec!r}: give ranks 0 to {world_size - 1} (or first, last), comma-separated")
        if value not in out:
            out.append(value)
    return out


def _trace(args) -> int:
    from meshforge.config import ConfigError, load_config
    from meshforge.planning.hardware import device_from_arg, with_links
    from meshforge.planning.headroom import headroom_from_arg
    from meshforge.scale.estimate import estimate

    fail = planning_cli._fail
    if args.config is None or args.world_size is None:
        return fail("--trace needs CONFIG and --world-size N (the job whose ranks it traces)")
    if args.calibrate or args.efficiency:
        return fail("--trace measures memory and collectives, not time: drop --calibrate/--efficiency")
    problem = planning_cli.arguments_problem(args)
    if problem:
        return fail(problem)
    if args.fit or args.compare:
        return fail("--trace traces one configuration: drop --fit and --compare")
    if args.trace_limit_s <= 0 or args.trace_limit_gb <= 0:
        return fail("--trace-limit-s and --trace-limit-gb must be positive")
    try:
        dev = with_links(device_from_arg(args.gpu or "h100"), args.link)
        headroom = headroom_from_arg(args.headroom)
        ranks = parse_ranks(args.ranks, args.world_size)
    except ValueError as err:
        return fail(str(err))
    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    except ConfigError as err:
        return fail(err.problems)
    problem = _untraceable(cfg)
    if problem:
        return fail(problem)
    over = []
    for r in ranks:
        e = estimate(cfg, args.world_size, r)
        if e.cpu_s > args.trace_limit_s or e.rss_bytes > args.trace_limit_gb * GB:
            over.append(f"tracing rank {r} is estimated at {e.cpu_s:.0f} CPU s and {e.rss_bytes / GB:.1f} GB "
                        f"({e.blocks} blocks x {e.microbatches} micro batches), over --trace-limit-s "
                        f"{args.trace_limit_s:g} / --trace-limit-gb {args.trace_limit_gb:g}: raise the limits or "
                        "trace a smaller step (fewer micro batches)")
    if over:
        return fail(over)
    return _run_traces(args, cfg, ranks, dev, headroom)


def _untraceable(cfg) -> str | None:
    """Why the trace cannot run this config yet (one line), or None."""
    if not cfg.model.hf_model:
        return None
    from meshforge.models import build_model, contract_of

    if contract_of(build_model(cfg.model, device="meta")).moe_layers():
        return ("model.hf_model with routed experts cannot be traced yet: transformers' experts route by the "
                "router's values (a data-dependent bincount and grouped matmul), which fake tensors do not have; "
                "its plan's state and collectives were checked against a 2-process run instead "
                "(tests/parallel/test_hf_model_parity.py)")
    return None


def _run_traces(args, cfg, ranks: list[int], dev, headroom) -> int:
    from meshforge.scale.compare import compare
    from meshforge.scale.trace import RankTrace, layout_of
    from meshforge.scale.worker import trace_jobs

    job = {"name": args.config, "path": args.config, "overrides": list(args.overrides)}
    rows, errors = [], []
    for r in ranks:
        t0 = time.perf_counter()
        res = trace_jobs(args.world_size, r, [job], timeout_s=max(600.0, 5 * args.trace_limit_s))[0]
        wall = time.perf_counter() - t0
        if "error" in res:
            errors.append(f"rank {r}: {res['error']}")
            continue
        trace = RankTrace.from_dict(res, layout_of(cfg, args.world_size))
        rows.append((trace, compare(cfg, trace, dev, headroom), wall))
    if errors:
        return planning_cli._fail(errors)
    if args.json:
        print(json.dumps([dict(t.to_dict(), wall_s=w, plan={"state": c.state_plan, "peak": c.peak_plan,
                                                             "comm": [{"axis": a, "kind": k, "bytes": b}
                                                                      for (a, k), b in sorted(c.comm_plan.items())]},
                               problems=c.problems()) for t, c, w in rows], indent=1))
        return 0
    _print(cfg, args, rows)
    return 0


def _print(cfg, args, rows) -> None:
    gb = planning_cli._gb
    lay = rows[0][0].layout
    print(f"trace: world {args.world_size} = pp {lay.pp} x dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}"
          f" x cp {lay.cp} x tp {lay.tp}{f' (ep {lay.ep})' if lay.ep > 1 else ''}, strategy "
          f"{cfg.distributed.strategy}; one real training step per rank on fake tensors (fake process group)")
    print(f"\n{'rank':>6} {'state plan':>11} {'trace':>11} {'peak plan':>11} {'trace':>11} {'diff':>7} "
          f"{'comm':>6} {'micro':>7} {'cpu s':>7} {'wall s':>7} {'RSS':>9}")
    for t, c, wall in rows:
        state = "exact" if c.state_exact else "DIFF"
        comm = "exact" if c.comm_exact else "DIFF"
        print(f"{t.rank:>6} {gb(sum(c.state_plan.values())):>11} {gb(sum(c.state_trace.values())):>11} "
              f"{gb(c.peak_plan):>11} {gb(c.peak_trace):>11} {100 * c.peak_error:>+6.1f}% {comm:>6} "
              f"{t.microbatches_run:>3}/{t.microbatches:<3} {t.cpu_s:>7.1f} {wall:>7.1f} {gb(t.rss_bytes):>9}"
              + ("" if c.state_exact else f"  state {state}"))
    for t, c, _ in rows:
        cats = ", ".join(f"{k} {gb(v)}" for k, v in t.peak.items() if v and k != "total")
        print(f"\nrank {t.rank}: peak {gb(t.peak['total'])} ({cats})")
        print(f"  {'axis':>12} {'kind':<16} {'plan':>12} {'trace':>12}")
        for key in sorted(set(c.comm_plan) | set(c.comm_trace), key=lambda k: -c.comm_trace.get(k, 0)):
            print(f"  {key[0]:>12} {key[1]:<16} {gb(c.comm_plan.get(key, 0)):>12} {gb(c.comm_trace.get(key, 0)):>12}")
        for line in c.problems():
            print(f"  plan differs: {line}")
        for note in t.notes:
            print(f"  note: {note}")
    sys.stdout.flush()
