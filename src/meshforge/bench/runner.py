"""Compose the configurations of a bench, validate them all up front, and run each in fresh processes.

A configuration is the user's overrides, then the `--use-megatron-fsdp` perf
overrides, then one value of each `--sweep` key (cartesian product when several
keys are swept), at one world size. Every configuration is validated (schema and
cross-field rules at its world size) before anything starts, so a bad value fails
in a second with exit code 2, not after minutes of earlier runs.

Each configuration runs in its own fresh processes (`meshforge.launch`, target
`meshforge.bench.worker:run`), so no state (allocator caches, compiled graphs,
process groups) leaks from one configuration into the next; with `--interleave` the
configurations of one world size share one launch and take their timed steps in turn
(`worker:run_interleaved`), so that a shared machine's changing load affects them alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from meshforge.config import ConfigError, load_config
from meshforge.config import rules as config_rules
from meshforge.config.schema import BRIDGE_SECTIONS
from meshforge.config.strategies import HARNESS_FLAGS
from meshforge.errors import BenchError
from meshforge.launch import launch

# `--use-megatron-fsdp true`: the spec's performance-harness settings in one flag, as the strategy's spec declares
# them (`StrategySpec.harness_overrides`)
MEGATRON_FSDP_PERF_OVERRIDES = list(HARNESS_FLAGS["use_megatron_fsdp"])


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
        raise BenchError(f"--sweep {text!r}: expected KEY=V1,V2,... (e.g. training.micro_batch_size=1,2)")
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
    return cfgs


def _launch(target: str, nproc: int, spec: dict, timeout: float) -> dict:
    res = launch(target, spec, nproc, timeout=timeout)
    if res.error is None:
        return res.value
    out = {"error": res.error}
    if res.errors:
        out["traceback"] = next(iter(res.errors.values())).get("traceback", "")
    else:  # killed by a signal or timed out: keep its output in bench.json for a post-mortem
        out["output"] = (res.stdout + "\n--- stderr\n" + res.stderr)[-20000:]
    return out


def run_config(config_path: str | None, c: BenchConfig, steps: int, warmup: int, peak_tflops: float | None,
               timeout: float, profile: bool = False) -> dict:
    spec = {"config": config_path, "overrides": c.overrides, "steps": steps, "warmup": warmup,
            "peak_tflops": peak_tflops, "profile": profile}
    return _launch("meshforge.bench.worker:run", c.nproc, spec, timeout)


def baseline_overrides(c: BenchConfig) -> list[str]:
    """The first configuration's settings at world size 1: model, batch and precision; no parallelism."""
    return [o for o in c.overrides if not o.startswith(tuple(f"{s}." for s in ("distributed", *BRIDGE_SECTIONS)))]


def run_baseline(config_path: str | None, c: BenchConfig, steps: int, warmup: int, rounds: int,
                 peak_tflops: float | None, timeout: float) -> dict:
    spec = {"config": config_path, "overrides": baseline_overrides(c), "steps": steps, "warmup": warmup,
            "rounds": rounds, "peak_tflops": peak_tflops}
    return _launch("meshforge.bench.baseline:run", 1, spec, timeout)


def run_interleaved(config_path: str | None, configs: list[BenchConfig], steps: int, warmup: int,
                    peak_tflops: float | None, timeout: float, profile: bool) -> list[dict]:
    """The configurations of one world size in one launch, stepped in turn (`worker.measure_interleaved`)."""
    spec = {"config": config_path, "overrides": [c.overrides for c in configs], "steps": steps, "warmup": warmup,
            "peak_tflops": peak_tflops, "profile": profile}
    res = _launch("meshforge.bench.worker:run_interleaved", configs[0].nproc, spec, timeout * len(configs))
    results = [res] * len(configs) if isinstance(res, dict) else res  # a failed launch fails every row
    return [{"name": c.name, "nproc": c.nproc, "overrides": c.overrides, "swept": c.swept, **r}
            for c, r in zip(configs, results)]


def run_all(config_path: str | None, configs: list[BenchConfig], steps: int, warmup: int,
            peak_tflops: float | None, baseline_rounds: int | None, timeout: float, progress=print,
            profile: bool = False, interleave: bool = False) -> dict:
    rows = []
    if interleave:
        for n in dict.fromkeys(c.nproc for c in configs):
            group = [c for c in configs if c.nproc == n]
            progress(f"bench: {len(group)} configuration(s) at N={n}, interleaved in one launch ...")
            rows += run_interleaved(config_path, group, steps, warmup, peak_tflops, timeout, profile and not rows)
            for r in rows[-len(group):]:
                if "error" in r:
                    progress(f"error: [{r['name']}] {r['error']}")
        configs = []
    for i, c in enumerate(configs):
        where = "" if "N=" in c.name else f" (N={c.nproc})"
        progress(f"bench [{i + 1}/{len(configs)}] {c.name}{where} ...")
        res = run_config(config_path, c, steps, warmup, peak_tflops, timeout, profile and i == 0)
        rows.append({"name": c.name, "nproc": c.nproc, "overrides": c.overrides, "swept": c.swept, **res})
        if "error" in res:
            progress(f"error: [{c.name}] {res['error']}")
    base = None
    if baseline_rounds:
        progress("bench baseline: bare PyTorch loop vs meshforge, interleaved, N=1 ...")
        base = run_baseline(config_path, configs[0], steps, warmup, baseline_rounds, peak_tflops, timeout)
        base["overrides"] = baseline_overrides(configs[0])
        if "error" in base:
            progress(f"error: [baseline] {base['error']}")
    return {"rows": rows, "baseline": base}
