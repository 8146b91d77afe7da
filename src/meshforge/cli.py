"""`meshforge` command line: thin commands, the logic lives in the packages.

Exit codes: 0 success (also a run preempted by SIGTERM/SIGUSR1 that saved); 2 bad input
(config, data, checkpoint) with one line per problem and no traceback; 3 a run that
stopped itself (non-finite loss); 130 Ctrl-C (the run saved). 2 and 3 come from the
`meshforge.errors` class raised. Flags and `key=value` overrides may come in any order.
Commands owned by other packages are a module with `add_arguments(parser)` and `run(args) -> int` (`SUBCOMMANDS`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from meshforge.errors import MeshforgeError

SUBCOMMANDS = {
    "checkpoint": ("meshforge.checkpoint.cli", "inspect, export and import checkpoints"),
    "bench": ("meshforge.bench.cli", "measure throughput, memory and communication; compare configurations"),
}


MAX_LINE = 600  # an error line quotes values cut to ~200 characters; this bounds whatever slipped through


def _fail(lines: list[str] | str, code: int = 2) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        line = str(line)
        if len(line) > MAX_LINE:
            line = f"{line[:MAX_LINE]}... ({len(line)} characters)"
        print(f"error: {line}", file=sys.stderr)
    return code


def _under_launcher() -> bool:
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1


# ------------------------------------------------------------------------------ train
def cmd_train(args) -> int:
    from meshforge.config import ConfigError, load_config

    world = args.nproc_per_node if args.nproc_per_node and not _under_launcher() else None
    try:
        from meshforge.distributed.env import env_world_size

        cfg = load_config(args.config, args.overrides, world_size=world or env_world_size())
    except ConfigError as err:
        return _fail(err.problems)
    if world and world > 1:
        from meshforge.launch import run_cli

        return run_cli(world, ["train", args.config, *args.overrides],
                       shutdown_timeout=int(cfg.checkpoint.grace_period_s) + 30)
    return run_training(cfg)


def run_training(cfg) -> int:
    from meshforge.training.trainer import train

    rank = int(os.environ.get("RANK", 0))
    try:
        result = train(cfg)
    except MeshforgeError as err:
        return _fail(err.problems, code=err.exit_code)
    except RuntimeError as err:  # a collective timed out or lost its peer: one clear line instead of a traceback
        first = (str(err).strip().splitlines() or [""])[0]
        if not any(s in first for s in ("Timed out", "timed out", "Connection reset", "Connection closed")):
            raise
        return _fail(f"rank {rank}: a collective failed ({first[:160]}): another rank died or hangs "
                     f"(distributed.timeout_minutes={cfg.distributed.timeout_minutes})", code=1)
    if rank == 0 and result.losses:
        print(f"done: steps {result.start_step}->{result.final_step}, first loss {result.losses[0]:.4f}, "
              f"last loss {result.losses[-1]:.4f}", flush=True)
    if result.signal == "SIGINT":
        if rank == 0:
            print(f"meshforge: interrupted (Ctrl-C) at step {result.final_step}: saved, exiting 130", file=sys.stderr)
        return 130
    return 0


# --------------------------------------------------------------------------- validate
def cmd_validate(args) -> int:
    from meshforge.config import ConfigError, load_config
    from meshforge.config.loader import dump_yaml
    from meshforge.config.rules import default_world_size, layout_of, warnings

    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    except ConfigError as err:
        return _fail(err.problems)
    world = args.world_size or default_world_size(cfg)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(dump_yaml(cfg), end="", markup=False, highlight=False)
    layout = layout_of(cfg, world)
    table = Table(title=f"rank layout, world size {world} (strategy {cfg.distributed.strategy})")
    for col in ("axis", "size", "groups (global ranks)"):
        table.add_column(col)
    for axis, size, groups in layout.table():
        table.add_row(axis, str(size), groups)
    console.print(table)
    notes = warnings(cfg, world)
    if args.gpus_per_node and cfg.distributed.tp_size > args.gpus_per_node:
        notes.append(f"distributed.tp_size={cfg.distributed.tp_size} exceeds --gpus-per-node={args.gpus_per_node}: "
                     "TP groups would cross nodes, which destroys throughput; keep TP inside a node")
    for w in notes:
        print(f"warning: {w}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    from meshforge.verify import verify

    return verify(args.nproc_per_node, args.steps)


# ------------------------------------------------------------------------------- data
def cmd_data(args) -> int:
    from meshforge.data.prepare import prepare

    try:
        n, out = prepare(args.inputs, args.output, args.dtype)
    except MeshforgeError as err:
        return _fail(err.problems, err.exit_code)
    except OSError as err:  # an unwritable or impossible --output (reading inputs raises DataError)
        return _fail(f"--output {args.output}: cannot write there ({err.strerror or type(err).__name__}): "
                     "choose a writable path")
    print(f"wrote {n} tokens to {out}")
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshforge", description="Train large language models on device meshes.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key.path=value edits")
    t.add_argument("--nproc-per-node", type=_positive, default=None, help="start N local processes (gloo on CPU)")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check a config (and its layout for a world size) without running")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.add_argument("--world-size", type=_positive, default=None)
    v.add_argument("--gpus-per-node", type=_positive, default=None)
    v.set_defaults(fn=cmd_validate)

    ve = sub.add_parser("verify", help="smoke-test every strategy on N local processes")
    ve.add_argument("--nproc-per-node", type=_positive, default=2)
    ve.add_argument("--steps", type=_positive, default=5)
    ve.set_defaults(fn=cmd_verify)

    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="text files -> byte-level token file (.npy)")
    prep.add_argument("inputs", nargs="*", help="files or globs (default: the Python standard library sources)")
    prep.add_argument("--output", "-o", required=True)
    prep.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    prep.set_defaults(fn=cmd_data)

    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as err:  # never vanish from --help: the command stays, and says why it cannot run
            why = f"{module} fails to import ({type(err).__name__}: {err})"
            sp = sub.add_parser(name, help=f"{help_text} [BROKEN: {why}]", add_help=False)
            sp.add_argument("rest", nargs=argparse.REMAINDER)
            sp.set_defaults(fn=lambda _args, name=name, why=why: _fail(f"meshforge {name} is broken: {why}", 1))
            continue
        sp = sub.add_parser(name, help=help_text)
        mod.add_arguments(sp)
        sp.set_defaults(fn=mod.run)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags and `key=value` overrides in any order, in every subcommand: argparse fills a `nargs="*"`
    positional only from the words before the first flag, so the later `key=value` words come back unknown
    and join the overrides here, in the order they were written. Anything else unknown is an error."""
    args, extra = parser.parse_known_args(argv)
    words = [w for w in extra if not w.startswith("-") and "=" in w]
    if words and isinstance(getattr(args, "overrides", None), list):
        args.overrides = [*args.overrides, *words]
        extra = [w for w in extra if w not in words]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves and exits 130 itself)
        print("meshforge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
