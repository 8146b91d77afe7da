"""`meshforge` command line: thin commands, the logic lives in the packages.

Exit codes: 0 success (also a run preempted by SIGTERM/SIGUSR1 that saved); 2 bad input
(config, data, checkpoint) with one line per problem and no traceback; 3 a run that
stopped itself (non-finite loss); 130 Ctrl-C (the run saved). 2 and 3 come from the
`meshforge.errors` class raised. Flags and `key=value` overrides may come in any order.
Commands owned by other packages are a module with `add_arguments(parser)` and `run(args) -> int` (`SUBCOMMANDS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time

from meshforge.errors import MeshforgeError

SUBCOMMANDS = {
    "checkpoint": ("meshforge.checkpoint.cli", "inspect, export and import checkpoints"),
    "eval": ("meshforge.evaluation.cli", "perplexity on held-out data and lm-eval tasks of a run or HF folder"),
    "bench": ("meshforge.bench.cli", "measure throughput, memory and communication; compare configurations"),
    "plan": ("meshforge.scale.cli", "memory per rank, communication and step time of a config, process-free; "
                                    "--trace runs the real step of chosen ranks on fake tensors beside it"),
    "generate": ("meshforge.generation.cli", "generate text from a run's checkpoint or a Hugging Face folder"),
    "plot": ("meshforge.plot", "draw loss, lr, grad norm, tokens/s and memory of runs against step (overlaid)"),
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
    """A rank of torchrun (or meshforge's launcher) or one task of a many-task srun step; an sbatch script is
    neither (`in_srun_task`), so `--nproc-per-node` there launches as asked."""
    from meshforge.distributed.env import env_world_size, in_srun_task

    return "RANK" in os.environ or in_srun_task() and env_world_size() > 1


def _follows_a_launcher() -> bool:
    """Whether this process must stop with the process that started it (`launch.stop_with_launcher`): a rank of
    a launcher, and every srun task, a one-task step's too (also one running meshforge's launcher for its node):
    srun's step daemon is its launcher."""
    from meshforge.distributed.env import in_srun_task

    return _under_launcher() or in_srun_task()


# ------------------------------------------------------------------------------ train
def _nodes(args):
    """`--nnodes/--node-rank/--rdzv-endpoint/--rdzv-id` -> this node's part of a multi-node launch (None when
    none is given); a flag that cannot work is one line each."""
    from meshforge.launch import Nodes

    given = [f for f in ("node_rank", "rdzv_endpoint", "rdzv_id") if getattr(args, f) is not None]
    if args.nnodes is None:
        return ["--" + given[0].replace("_", "-") + " needs --nnodes"] if given else None
    problems = []
    if args.nnodes < 1:
        problems.append(f"--nnodes={args.nnodes} must be at least 1")
    if not args.nproc_per_node:
        problems.append("--nnodes needs --nproc-per-node (processes per node, usually its GPU count)")
    if args.node_rank is not None and not 0 <= args.node_rank < max(args.nnodes, 1):
        problems.append(f"--node-rank={args.node_rank} must be in [0, {args.nnodes - 1}] for --nnodes={args.nnodes}")
    endpoint = args.rdzv_endpoint
    if endpoint is None:
        if args.nnodes > 1:
            problems.append(f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT (an address of node 0 "
                            "that every node can reach)")
        endpoint = "127.0.0.1:29500"
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(f"--rdzv-endpoint={endpoint!r} is not HOST:PORT")
    if args.rdzv_id is not None and args.node_rank is not None:
        problems.append("--rdzv-id is for the c10d rendezvous (no --node-rank); with --node-rank the static "
                        "rendezvous needs none: drop one of them")
    return problems or Nodes(args.nnodes, endpoint, args.node_rank, args.rdzv_id or "meshforge")


def cmd_train(args) -> int:
    from meshforge.config import ConfigError, load_config
    from meshforge.launch import launch_env_problems

    if problems := launch_env_problems():
        return _fail(problems)
    nodes = _nodes(args)
    if isinstance(nodes, list):
        return _fail(nodes)
    if args.max_restarts is not None:  # the flag is the YAML key, validated with the config
        args.overrides = [*args.overrides, f"resilience.max_restarts={args.max_restarts}"]
    # with --nnodes this process is its node's launcher, even inside an `srun` task
    world = args.nproc_per_node if args.nproc_per_node and (nodes or not _under_launcher()) else None
    try:
        from meshforge.distributed.env import env_world_size

        cfg = load_config(args.config, args.overrides, world_size=world * (nodes.nnodes if nodes else 1)
                          if world else env_world_size())
    except ConfigError as err:
        return _fail(err.problems)
    from meshforge.launch import RESTART, run_cli

    if nodes:
        nodes = dataclasses.replace(nodes, timeout_s=cfg.distributed.rendezvous_timeout_s)

    restarts = cfg.resilience.max_restarts
    if restarts and _under_launcher() and not nodes and RESTART not in os.environ:
        return _fail(f"resilience.max_restarts={restarts} needs meshforge's launcher (meshforge train "
                     "--nproc-per-node N); under torchrun pass torchrun --max-restarts, under srun use the "
                     "scheduler's requeue")
    if nodes or (world and world > 1) or (restarts and not _under_launcher()):
        from meshforge.distributed.hang import dump_summary, nccl_dump_prefix

        if _follows_a_launcher():  # meshforge's launcher as one srun task: it follows srun's step daemon
            from meshforge.launch import stop_with_launcher

            stop_with_launcher()
        started = time.time()
        code = run_cli(world or 1, ["train", args.config, *args.overrides], nodes,
                       shutdown_timeout=int(cfg.checkpoint.grace_period_s) + 30, max_restarts=restarts)
        if code:  # NCCL's flight recorder dumped the ranks' traces on a timeout: where the job hung
            for line in dump_summary(nccl_dump_prefix(cfg.run.output_dir), since=started):
                print(line, file=sys.stderr, flush=True)
        return code
    return run_training(cfg)


def run_training(cfg) -> int:
    from meshforge.distributed.env import apply_slurm_env
    from meshforge.launch import note_failure, stop_with_launcher
    from meshforge.training.trainer import train

    if _follows_a_launcher():  # a rank of meshforge's launcher, torchrun or srun: it never outlives its launcher
        stop_with_launcher()
    apply_slurm_env()  # under srun: RANK before it is read here
    rank = int(os.environ.get("RANK", 0))
    try:
        result = train(cfg)
    except MeshforgeError as err:
        note_failure(rank, "; ".join(err.problems))  # the cause a restarting launcher reports
        return _fail(err.problems, code=err.exit_code)
    except RuntimeError as err:  # a collective timed out or lost its peer: one clear line instead of a traceback
        first = (str(err).strip().splitlines() or [""])[0]
        if not any(s in first for s in ("Timed out", "timed out", "Connection reset", "Connection closed")):
            note_failure(rank, f"RuntimeError: {first[:300]}")
            raise
        from meshforge.distributed.hang import failed_line

        line = failed_line(rank, err, cfg.distributed.timeout_minutes)  # (a recorded one ended in distributed/hang.py)
        note_failure(rank, line, secondary=True)
        return _fail(line, code=1)
    except Exception as err:
        note_failure(rank, f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}")
        raise
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
    gpn = args.gpus_per_node
    if gpn is not None and (gpn < 1 or world % gpn):
        return _fail(f"--gpus-per-node={gpn} must be positive and divide the world size {world}")
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(dump_yaml(cfg), end="", markup=False, highlight=False)
    layout = layout_of(cfg, world)
    spans = layout.nodes_spanned(gpn) if gpn else {}
    nodes = f", {world // gpn} nodes of {gpn}" if gpn else ""
    table = Table(title=f"rank layout, world size {world}{nodes} (strategy {cfg.distributed.strategy})")
    for col in ("axis", "size", *(["nodes per group"] if gpn else []), "groups (global ranks)"):
        table.add_column(col)
    for axis, size, groups in layout.table():
        table.add_row(axis, str(size), *([str(spans[axis])] if gpn else []), groups)
    console.print(table)
    notes = warnings(cfg, world)
    for axis in ("tp", "cp"):  # per-layer collectives on the critical path: they want NVLink, not the network
        if spans.get(axis, 1) > 1:
            notes.append(f"{axis.upper()} groups span {spans[axis]} nodes (distributed.{axis}_size="
                         f"{layout.size(axis)}, --gpus-per-node={gpn}): their per-layer collectives would cross "
                         f"the network; keep {axis}_size a divisor of the GPUs per node")
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
        n, out = prepare(args.inputs, args.output, args.dtype, args.tokenizer, args.text_field)
    except MeshforgeError as err:
        return _fail(err.problems, err.exit_code)
    except OSError as err:  # an unwritable or impossible --output (reading inputs raises DataError)
        return _fail(f"--output {args.output}: cannot write there ({err.strerror or type(err).__name__}): "
                     "choose a writable path")
    print(f"wrote {n} tokens to {out}")
    return 0


def cmd_tokenizer_train(args) -> int:
    from meshforge.data.tokenizer import train_tokenizer

    try:
        n, out = train_tokenizer(args.inputs, args.vocab_size, args.output)
    except MeshforgeError as err:
        return _fail(err.problems, err.exit_code)
    print(f"wrote a {n}-token BPE tokenizer to {out}")
    return 0


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return n


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line, as every other bad input is (argparse prints its whole usage first); the
    subcommands' parsers are of this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (`{self.prog} --help` lists the arguments)\n")

    def subcommand(self, args: argparse.Namespace) -> _Parser:
        """The parser of the subcommand `args` came from (for an error found after parsing)."""
        parser = self
        for dest in ("command", "data_command", "tokenizer_command", "checkpoint_command"):
            action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if action is None or getattr(args, dest, None) not in action.choices:
                break
            parser = action.choices[getattr(args, dest)]
        return parser


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="meshforge", description="Train large language models on device meshes.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train from a YAML config")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", default=[], help="key.path=value edits")
    t.add_argument("--nproc-per-node", type=_positive, default=None, help="start N local processes (gloo on CPU)")
    t.add_argument("--nnodes", type=int, default=None, help="nodes of a multi-node launch (this is one of them)")
    t.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous); "
                   "omit it for the c10d rendezvous, which assigns node ranks")
    t.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of node 0 that every node reaches")
    t.add_argument("--rdzv-id", default=None, help="c10d rendezvous: the job id every node passes (default meshforge)")
    t.add_argument("--max-restarts", type=int, default=None, help="restart the whole job after a rank fails, up to N "
                   "times, resuming from the last committed checkpoint (= resilience.max_restarts)")
    t.set_defaults(fn=cmd_train)

    v = sub.add_parser("validate", help="check a config (and its layout for a world size) without running")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*", default=[])
    v.add_argument("--world-size", type=_positive, default=None)
    v.add_argument("--gpus-per-node", type=_positive, default=None)
    v.set_defaults(fn=cmd_validate)

    ve = sub.add_parser("verify", help="smoke-test every strategy on N local processes")
    ve.add_argument("--nproc-per-node", type=_positive, default=2)
    ve.add_argument("--steps", type=_positive, default=5)
    ve.set_defaults(fn=cmd_verify)

    d = sub.add_parser("data", help="data tools")
    dsub = d.add_subparsers(dest="data_command", required=True)
    prep = dsub.add_parser("prepare", help="text or record files -> token file (.npy)")
    prep.add_argument("inputs", nargs="*", help="files or globs (default: the Python standard library sources)")
    prep.add_argument("--output", "-o", required=True)
    prep.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    prep.add_argument("--tokenizer", default=None, help="a tokenizer.json or tokenizer folder (default: byte-level)")
    prep.add_argument("--text-field", default="text", help="the text field of jsonl/parquet/arrow records")
    prep.set_defaults(fn=cmd_data)
    tk = dsub.add_parser("tokenizer", help="tokenizer tools")
    tksub = tk.add_subparsers(dest="tokenizer_command", required=True)
    tkt = tksub.add_parser("train", help="train a byte-level BPE tokenizer on local text files")
    tkt.add_argument("inputs", nargs="+", help="files or globs")
    tkt.add_argument("--vocab-size", type=int, required=True)
    tkt.add_argument("--output", "-o", required=True, help="the tokenizer folder to write")
    tkt.set_defaults(fn=cmd_tokenizer_train)

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


def parse_args(parser: _Parser, argv: list[str] | None) -> argparse.Namespace:
    """Flags and `key=value` overrides in any order, in every subcommand: argparse fills a `nargs="*"`
    positional only from the words before the first flag, so the later `key=value` words come back unknown
    and join the overrides here, in the order they were written. Anything else unknown is an error."""
    args, extra = parser.parse_known_args(argv)
    words = [w for w in extra if not w.startswith("-") and "=" in w]
    if words and isinstance(getattr(args, "overrides", None), list):
        args.overrides = [*args.overrides, *words]
        extra = [w for w in extra if w not in words]
    if extra:
        parser.subcommand(args).error(f"unrecognized arguments: {' '.join(extra)}")
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
