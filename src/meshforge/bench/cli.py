"""`meshforge bench CONFIG [overrides] [--nproc-per-node N] [--steps S] [--warmup W]
[--use-megatron-fsdp true|false] [--sweep key=v1,v2,...] [--baseline] [--peak-tflops T] [--output-dir D]
[--interleave] [--profile-device]`

Thin command: compose and validate the configurations (exit 2 on any bad input,
before anything runs), run each in fresh processes (`runner`), print the table and
write bench.json / bench.md / bench.png (`report`). Exit 1 if a configuration
failed at run time (its row says why), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from meshforge.errors import BenchError


def _bool(text: str) -> bool:
    v = str(text).strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (the base of every configuration)")
    p.add_argument("overrides", nargs="*", default=[], help="key.path=value edits applied to every configuration")
    p.add_argument("--nproc-per-node", default="1",
                   help="processes per configuration (gloo on CPU); a list like 1,2,4 runs each world size")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps first (default 3)")
    p.add_argument("--use-megatron-fsdp", type=_bool, default=False, metavar="true|false",
                   help="Megatron-FSDP with the performance-harness settings its strategy spec declares (ZeRO-3, "
                        "no averaging inside the collective, no fp8 transpose cache, no checkpoint loading)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="one configuration per value (repeat the flag to sweep several keys: all combinations)")
    p.add_argument("--baseline", action="store_true",
                   help="also time a hand-written PyTorch loop on the first configuration's model, batch and "
                        "precision at world size 1, interleaved with meshforge's step, and print the ratio")
    p.add_argument("--baseline-rounds", type=int, default=6,
                   help="the baseline interleaves rounds x steps pairs of steps (default 6)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak TFLOP/s for MFU (default: the table in training/metrics.py; none on CPU)")
    p.add_argument("--output-dir", default=None, help="where bench.json/md/png go (default <run.output_dir>/bench)")
    p.add_argument("--interleave", action="store_true",
                   help="run the configurations of each world size in one launch, their timed steps in turn (for a "
                        "shared machine whose load changes; their memory adds up)")
    p.add_argument("--profile-device", action="store_true",
                   help="also measure the device (matmul size curve, attention, memory bandwidth, collectives) in "
                        "the first configuration's processes, for `meshforge plan --calibrate OUTPUT_DIR`")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per configuration (default 1800)")


def _fail(lines) -> int:
    for line in [lines] if isinstance(lines, str) else lines:
        print(f"error: {line}", file=sys.stderr)
    return 2


def run(args) -> int:
    from meshforge.bench import report, runner

    if "RANK" in os.environ:
        return _fail("meshforge bench starts its own processes: run it plainly, not under torchrun or srun")
    if args.steps < 1 or args.warmup < 0 or args.baseline_rounds < 1:
        return _fail(f"--steps={args.steps} must be >= 1, --warmup={args.warmup} >= 0 and "
                     f"--baseline-rounds={args.baseline_rounds} >= 1")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        return _fail(f"--peak-tflops={args.peak_tflops} must be positive")
    if not os.path.isfile(args.config):
        return _fail(f"config {args.config!r} does not exist")
    try:
        configs = runner.compose(args.overrides, args.sweep, runner.parse_nprocs(args.nproc_per_node),
                                 args.use_megatron_fsdp)
        cfgs = runner.validate(args.config, configs)
    except BenchError as err:
        return _fail(err.problems)
    out_dir = args.output_dir or os.path.join(cfgs[0].run.output_dir, "bench")

    result = runner.run_all(args.config, configs, args.steps, args.warmup, args.peak_tflops,
                            args.baseline_rounds if args.baseline else None, args.timeout,
                            progress=lambda m: print(m, file=sys.stderr, flush=True), profile=args.profile_device,
                            interleave=args.interleave)
    ok = [r for r in result["rows"] if "error" not in r]
    result["meta"] = {"config": os.path.abspath(args.config), "overrides": args.overrides, "sweep": args.sweep,
                      "use_megatron_fsdp": args.use_megatron_fsdp, "steps": args.steps, "warmup": args.warmup,
                      "device": ok[0]["device_name"] if ok else "?"}
    import torch

    result["meta"]["torch"] = torch.__version__
    report.print_table(result)
    paths = report.write_outputs(result, out_dir)
    for kind in ("json", "md", "png"):
        p = paths[kind]
        print(f"wrote {p}" if not isinstance(p, str) else p)
    failed = [r["name"] for r in result["rows"] if "error" in r]
    if result.get("baseline") and "error" in result["baseline"]:
        failed.append("baseline")
    if failed:
        print(f"error: {len(failed)} configuration(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
