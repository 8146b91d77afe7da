"""Compose the configurations of a bench, validate them all up front, and run each in fresh processes.

A configuration is the user's overrides, then the `--use-megatron-fsdp` perf
overrides, then one value of each `--sweep` key (cartesian product when several
keys are swept), at one world size. Every configuration is validated (schema and
cross-field rules at its world size) before anything starts, so a bad value fails
in a second with exit code 2, not after minutes of earlier runs.

Each configuration runs in its own process group: `python -m meshforge.bench.worker`
at N=1, `python -m torch.distributed.run --standalone --nproc-per-node N -m
meshforge.bench.worker` above, so no state (allocator caches, compiled graphs,
process groups) leaks from one configuration into the next.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# `--use-megatron-fsdp true`: the spec's performance-harness settings in one flag
MEGATRON_FSDP_PERF_OVERRIDES = [
    "distributed.strategy=megatron_fsdp",
    "distributed.data_parallel_sharding_strategy=optim_grads_params",
    "distributed.average_in_collective=false",
    "distributed.keep_fp8_transpose_cache=false",
    "checkpoint.resume=none",
]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


class BenchError(ValueError):
    """Bad bench input: one line per problem, exit code 2."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


@dataclass
class BenchConfig:
    name: str
    overrides: list[str]
    nproc: int
    swept: dict[str, str] = field(default_factory=dict)


def parse_sweep(text: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    vals = [v.strip() for v in values.split(",")] if sep else []
    if not sep or not key.strip() or not vals or any(not v for v in vals):
        raise BenchError(f"--sweep {text!r}: expected KEY=V1,V2,... (e.g. distributed.strategy=ddp,fsdp2)")
    if len(set(vals)) != len(vals):
        raise BenchError(f"--sweep {text!r}: a value is repeated")
    return key.strip(), vals


def parse_nprocs(text: str | int) -> list[int]:
    try:
        ns = [int(v) for v in str(text).split(",")]
    except ValueError:
        ns = []
    if not ns or any(n < 1 for n in ns):
        raise BenchError(f"--nproc-per-node={text!r}: expected a positive integer or a list like 1,2,4")
    return ns


def compose(overrides: list[str], sweeps: list[str], nprocs: list[int], use_megatron_fsdp: bool) -> list[BenchConfig]:
    base = list(overrides) + (MEGATRON_FSDP_PERF_OVERRIDES if use_megatron_fsdp else [])
    parsed = [parse_sweep(s) for s in sweeps]
    keys = [k for k, _ in parsed]
    if len(set(keys)) != len(keys):
        raise BenchError(f"--sweep: key swept twice: {sorted({k for k in keys if keys.count(k) > 1})}")
    configs = []
    for n in nprocs:
        for combo in itertools.product(*[vals for _, vals in parsed]) if parsed else [()]:
            swept = dict(zip(keys, combo))
            parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in swept.items()]
            if len(nprocs) > 1 or not parts:
                parts.append(f"N={n}")
            configs.append(BenchConfig(" ".join(parts), base + [f"{k}={v}" for k, v in swept.items()], n, swept))
    return configs


def validate(config_path: str | None, configs: list[BenchConfig]) -> list:
    """Load and rule-check every configuration at its world size; returns the Configs or raises BenchError."""
    from meshforge.config import ConfigError, load_config
    from meshforge.config import rules as config_rules

    problems, cfgs = [], []
    for c in configs:
        try:
            cfg = load_config(config_path, c.overrides, world_size=c.nproc)
            probs = config_rules.check(cfg, c.nproc)
        except ConfigError as err:
            cfg, probs = None, err.problems
        problems += [f"[{c.name}] {p}" for p in probs]
        cfgs.append(cfg)
    if problems:
        raise BenchError(problems)
    if any(cfg.distributed.strategy == "megatron_fsdp" for cfg in cfgs) and not megatron_fsdp_available():
        raise BenchError("distributed.strategy=megatron_fsdp is not registered in this build "
                         "(meshforge.distributed.megatron_fsdp is missing): bench ddp or fsdp2 instead")
    return cfgs


def megatron_fsdp_available() -> bool:
    from meshforge.distributed import strategy as strategy_mod

    try:
        import meshforge.distributed.megatron_fsdp  # noqa: F401 - registers the strategy
    except ImportError:
        pass
    return "megatron_fsdp" in strategy_mod._REGISTRY


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}


def _launch(module: str, nproc: int, spec: dict, workdir: Path, tag: str, timeout: float) -> dict:
    spec_path, out_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    spec_path.write_text(json.dumps(spec))
    if nproc == 1:
        cmd = [sys.executable, "-m", module, str(spec_path), str(out_path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "-m", module, str(spec_path), str(out_path)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out_path.exists() and proc.returncode == 0:
        return json.loads(out_path.read_text())
    errs = sorted(workdir.glob(f"{tag}.result.json.rank*.err"))
    if errs:
        first = json.loads(errs[0].read_text())
        return {"error": first["error"], "traceback": first.get("traceback", "")}
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
    # a launch killed by a signal leaves no .err file: keep its output in bench.json for a post-mortem
    return {"error": f"exit code {proc.returncode}: " + " | ".join(tail),
            "output": ((proc.stdout or "") + "\n--- stderr\n" + (proc.stderr or ""))[-20000:]}


def run_config(config_path: str | None, c: BenchConfig, steps: int, warmup: int, peak_tflops: float | None,
               workdir: Path, index: int, timeout: float) -> dict:
    spec = {"config": config_path, "overrides": c.overrides, "steps": steps, "warmup": warmup,
            "peak_tflops": peak_tflops}
    return _launch("meshforge.bench.worker", c.nproc, spec, workdir, f"cfg{index}", timeout)


def baseline_overrides(c: BenchConfig) -> list[str]:
    """The first configuration's settings at world size 1: model, batch and precision; no parallelism."""
    return [o for o in c.overrides if not o.startswith(("distributed.", "dist.", "ddp."))]


def run_baseline(config_path: str | None, c: BenchConfig, steps: int, warmup: int, rounds: int,
                 peak_tflops: float | None, workdir: Path, timeout: float) -> dict:
    spec = {"config": config_path, "overrides": baseline_overrides(c), "steps": steps, "warmup": warmup,
            "rounds": rounds, "peak_tflops": peak_tflops}
    return _launch("meshforge.bench.baseline", 1, spec, workdir, "baseline", timeout)


def run_all(config_path: str | None, configs: list[BenchConfig], steps: int, warmup: int,
            peak_tflops: float | None, baseline_rounds: int | None, timeout: float, progress=print) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshforge-bench-") as tmp:
        workdir = Path(tmp)
        for i, c in enumerate(configs):
            where = "" if "N=" in c.name else f" (N={c.nproc})"
            progress(f"bench [{i + 1}/{len(configs)}] {c.name}{where} ...")
            res = run_config(config_path, c, steps, warmup, peak_tflops, workdir, i, timeout)
            rows.append({"name": c.name, "nproc": c.nproc, "overrides": c.overrides, "swept": c.swept, **res})
            if "error" in res:
                progress(f"error: [{c.name}] {res['error']}")
        base = None
        if baseline_rounds:
            progress("bench baseline: bare PyTorch loop vs meshforge, interleaved, N=1 ...")
            base = run_baseline(config_path, configs[0], steps, warmup, baseline_rounds, peak_tflops, workdir,
                                timeout)
            base["overrides"] = baseline_overrides(configs[0])
            if "error" in base:
                progress(f"error: [baseline] {base['error']}")
    return {"rows": rows, "baseline": base}
