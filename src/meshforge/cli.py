"""`meshforge` command line: thin commands, the logic lives in the packages.

Exit codes: 0 success; 2 bad input (config, data, checkpoint) with one line per
problem and no traceback; 3 a run that stopped itself (non-finite loss). Both come
from the `meshforge.errors` class raised. Commands owned by other packages are a
module with `add_arguments(parser)` and `run(args) -> int` (`SUBCOMMANDS`).
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
    "plan": ("meshforge.planning.cli", "memory per rank, communication and step time of a config, process-free"),
}


def _fail(lines: list[str] | str, code: int = 2) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
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

        return run_cli(world, ["train", args.config, *args.overrides])
    return run_training(cfg)


def run_training(cfg) -> int:
    from meshforge.config.loader import write_yaml
    from meshforge.training.trainer import train

    rank = int(os.environ.get("RANK", 0))
    try:
        if rank == 0:
            write_yaml(cfg, os.path.join(cfg.run.output_dir, "config.yaml"))
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
    from meshforge.planning.cli import memory_warning

    notes += [w for w in [memory_warning(cfg, world)] if w]
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
    print(f"wrote {n} tokens to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshforge", description="Train large language models on device meshes.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="key.path=value edits")
    t.add_argument("--nproc-per-node", type=int, default=None, help="start N local processes (gloo on CPU)")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check a config (and its layout for a world size) without running")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.add_argument("--world-size", type=int, default=None)
    v.add_argument("--gpus-per-node", type=int, default=None)
    v.set_defaults(fn=cmd_validate)

    ve = sub.add_parser("verify", help="smoke-test every strategy on N local processes")
    ve.add_argument("--nproc-per-node", type=int, default=2)
    ve.add_argument("--steps", type=int, default=5)
    ve.set_defaults(fn=cmd_verify)

    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="text files -> byte-level token file (.npy)")
    prep.add_argument("inputs", nargs="*", help="files or globs (default: the Python standard library sources)")
    prep.add_argument("--output", "-o", required=True)
    prep.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    prep.set_defaults(fn=cmd_data)

    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text)
        mod.add_arguments(sp)
        sp.set_defaults(fn=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
