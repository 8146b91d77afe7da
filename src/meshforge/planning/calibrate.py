"""`meshforge plan --calibrate RUN_DIR`: fit the time model's efficiencies to a measured run, save them for later
plans (`--efficiency FILE`).

What is read. A `meshforge bench` output (bench.json: each row's config, world size and median step time; on CPU
its busy time, the slowest rank's process CPU time per step, since a CPU core is the device and a shared machine's
wall time holds other jobs' load) or a run directory (metrics.jsonl's tokens/s after the first logged interval,
run_meta.json's config and world size). A bench run with `--profile-device` also carries the device's measured
matmul size curve, attention rate per sequence length, memory bandwidth and collective bandwidth and latency
(bench/device_profile.py): the device is then made from those (a CPU core always is: it has no datasheet);
otherwise it is the named GPU's datasheet entry with its stated default efficiencies.

What is fitted. Each measured layout is planned with the device's efficiencies; the one number the measurement
adds is `compute_scale`, the least-squares ratio of measured to modelled compute once the modelled communication
is taken off (what the shapes do not explain: framework overhead, kernels slower than the profile's, clocks).
With several layouts whose communication shares differ, the communication efficiency is fitted beside it. The
file keeps the device, the efficiencies and each row's measured and fitted time; every later plan prints where
its efficiencies came from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from meshforge.errors import CalibrationError
from meshforge.planning.hardware import DEVICES, Device, Efficiency, default_efficiency

EFFICIENCY_FILE = "efficiency.json"


@dataclass
class Measurement:
    name: str
    cfg: object
    world_size: int
    seconds: float  # per optimizer step
    clock: str  # "busy" (device busy time: CPU time on CPU) or "wall"
    device: str  # "cpu" or a CUDA device name
    kernels: dict | None = None  # seconds in the counted step's kernels by kind (the bench on CPU)


def read_run(run_dir: str | Path) -> tuple[list[Measurement], dict | None]:
    """The measured layouts of a bench output or a run directory, and the device profile if one was measured."""
    d = Path(run_dir)
    if (d / "bench.json").is_file():
        return _read_bench(d)
    if (d / "metrics.jsonl").is_file():
        return [_read_metrics(d)], None
    raise CalibrationError(f"--calibrate {run_dir}: no bench.json (a `meshforge bench --output-dir` folder) or "
                           "metrics.jsonl (a run's output_dir) there")


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CalibrationError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


def _read_bench(d: Path) -> tuple[list[Measurement], dict | None]:
    from meshforge.config import ConfigError, load_config

    res = _load(d / "bench.json")
    meta = res.get("meta", {})
    config = meta.get("config")
    if config and not Path(config).is_file():
        raise CalibrationError(f"{d}/bench.json: its config {config} is gone; rerun the bench or restore the file")
    out, profile = [], None
    for row in res.get("rows", []):
        if "error" in row:
            continue
        try:
            cfg = load_config(config, row["overrides"], world_size=row["world_size"])
        except ConfigError as err:
            raise CalibrationError(f"{d}/bench.json row {row['name']}: {err.problems[0]}") from None
        busy = row.get("step_busy_s_median")
        out.append(Measurement(row["name"], cfg, row["world_size"], busy or row["step_s_median"],
                               "busy" if busy else "wall", row.get("device_name", "?"), row.get("step_kernels_s")))
        profile = profile or row.get("device_profile")
    if not out:
        raise CalibrationError(f"{d}/bench.json has no successful row to calibrate on")
    return out, profile


def _read_metrics(d: Path) -> Measurement:
    from meshforge.config import ConfigError
    from meshforge.config.loader import resolve

    meta_path = d / "run_meta.json"
    if not meta_path.is_file():
        raise CalibrationError(f"{d}: metrics.jsonl without run_meta.json (logging.loggers must include jsonl)")
    run_meta = _load(meta_path)
    world = int(run_meta.get("meta", {}).get("world_size", 1))
    try:
        cfg = resolve(run_meta["config"], world)
    except ConfigError as err:
        raise CalibrationError(f"{meta_path}: its config does not load: {err.problems[0]}") from None
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records[1:] if r.get("tokens_per_s")]  # the first interval compiles/warms
    if not rates:
        raise CalibrationError(f"{d}/metrics.jsonl: fewer than two logged intervals with tokens_per_s; log more "
                               "often (logging.log_every) or train longer")
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    device = str(run_meta.get("meta", {}).get("device", "?"))
    return Measurement(d.name, cfg, world, tokens / statistics.median(rates), "wall",
                       "cpu" if device.startswith("cpu") else device)


# ------------------------------------------------------------------------------------------ the device profile
def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of y = a + b*x by least squares in relative error (each point weighted by 1/y), a >= 0."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else sy / sx
    a = (sy - b * sx) / sw
    if a < 0 or b <= 0:  # no fixed part to find: a straight proportion
        a, b = 0.0, sxy / sxx
    return a, b


def device_from_profile(profile: dict, gpus_per_node: int) -> tuple[Device, Efficiency]:
    """The measured device: its matmul rate is the peak (so `gemm` is 1) for a CPU core; a GPU keeps its datasheet
    peak and gets the measured fraction of it."""
    load = 1.0
    if profile.get("probe_rounds_s") and profile.get("probe_s"):  # the timed steps' load over the profile's
        load = statistics.median(profile["probe_rounds_s"]) / profile["probe_s"]
    profile = _scaled(profile, load)
    rate_inv = _fit_line([2 * m * n * k for m, n, k, _s in profile["matmul"]], [s for *_x, s in profile["matmul"]])
    overhead, per_flop = rate_inv
    rate = 1 / per_flop
    k = profile["kernels"]  # the model's own elementwise kernels: their bytes over their time
    mem_gbps = k["elementwise_bytes"] / k["seconds"]["elementwise"] / 1e9
    cpu = profile["device"] == "cpu"
    known = datasheet_device(profile.get("device_name", ""), None)
    peak = rate / 1e12 if cpu or known is None else known.peak_tflops
    att = tuple(sorted((int(s), f / t / (peak * 1e12)) for s, _h, _hd, f, t in profile["attention"]))
    links, latency = _links(profile, gpus_per_node)
    base = default_efficiency(known) if known is not None else None
    name = "cpu" if cpu else (known.name if known else profile.get("device_name", "gpu"))
    dev = Device(name, peak, round(profile["memory_gib"], 1),
                 links or (known.nvlink_gbps if known else 0.0), links or (known.fabric_gbps if known else 0.0),
                 mem_gbps if cpu or known is None else known.mem_gbps)
    eff = Efficiency(gemm=1.0 if cpu else rate / (peak * 1e12), gemm_overhead_s=overhead, attention=att,
                     memory=1.0 if cpu or known is None else mem_gbps / known.mem_gbps,
                     comm=1.0 if links else (base.comm if base else 0.8),
                     comm_latency_s=latency if links else (base.comm_latency_s if base else 20e-6),
                     overlap=not cpu, fp8_gemm_speedup=1.0 if cpu or base is None else base.fp8_gemm_speedup,
                     source=f"measured ({profile['clock']}, {profile.get('threads', '?')} thread(s)"
                            f"{f', times x{load:.3f} for the load of the timed steps' if load != 1.0 else ''})")
    return dev, eff


def _scaled(profile: dict, load: float) -> dict:
    """The profile with every measured time multiplied by `load`."""
    if load == 1.0:
        return profile
    out = dict(profile)
    out["matmul"] = [[m, n, k, s * load] for m, n, k, s in profile["matmul"]]
    out["attention"] = [[*x, s * load] for *x, s in profile["attention"]]
    out["kernels"] = dict(profile["kernels"], seconds={k: v * load for k, v in profile["kernels"]["seconds"].items()})
    if profile.get("collectives"):
        out["collectives"] = [[kind, b, s * load] for kind, b, s in profile["collectives"]]
    return out


def _links(profile: dict, gpus_per_node: int) -> tuple[float | None, float]:
    """(GB/s, seconds per call) of the measured collectives on the ring model step.comm_seconds prices them with."""
    rows = profile.get("collectives") or []
    if not rows:
        return None, 0.0
    n = profile.get("world_size", 2)
    xs = [(2 if kind == "all_reduce" else 1) * b * (n - 1) / n for kind, b, _s in rows]
    lat, per_byte = _fit_line(xs, [s for *_x, s in rows])
    return 1 / per_byte / 1e9, lat


def datasheet_device(device_name: str, default: str | None = "h100") -> Device | None:
    """The table's device a CUDA device name names (`NVIDIA H100 80GB HBM3` -> h100), else `default`'s."""
    up = device_name.upper()
    for key in sorted(DEVICES, key=len, reverse=True):
        if key.upper() in up:
            return DEVICES[key]
    return DEVICES[default] if default else None


# ------------------------------------------------------------------------------------------ the fit
def calibrate(measured: list[Measurement], device: Device, eff: Efficiency, gpus_per_node: int,
              source: str, kernels_measured: bool) -> Efficiency:
    """`eff` fitted to the measured step times. With the device's kernels measured (a profile) on a device that
    does not overlap its host with its compute (a CPU core): a scale on the modelled kernels and the framework's
    host time per call, told apart by the counted step's own split (its time in kernels and the rest), or, for
    several layouts whose shares differ, by least squares. Otherwise a scale on the modelled compute (least
    squares in relative error). `fit` holds each layout's measured and fitted seconds."""
    terms = [_terms(m, device, eff, gpus_per_node) for m in measured]
    ys = [m.seconds for m in measured]
    split = [_split(m, t) for m, t in zip(measured, terms)]
    host_fit = kernels_measured and not eff.overlap
    if host_fit and not _apart(terms) and all(x is not None for x in split):
        scale, host = statistics.median(x[0] for x in split), statistics.median(x[1] for x in split)
        how = "kernel scale and host time per call, split as the counted step's kernels and the rest"
    else:
        both = not eff.overlap and _apart(terms)
        scale, host = _solve(terms, ys, fit_scale=True, fit_host=both)
        how = "kernel scale and host time per call, least squares" if both else "a scale on compute"
    cur = dataclasses.replace(eff, compute_scale=scale, host_s_per_call=host)
    rows = [{"name": m.name, "world_size": m.world_size, "clock": m.clock, "measured_s": m.seconds,
             "fitted_s": _model_seconds(m, device, cur, gpus_per_node)} for m in measured]
    names = ", ".join(m.name for m in measured)
    return dataclasses.replace(cur, source=f"calibrated on {source} ({names}; {measured[0].clock} time; fitted: "
                                           f"{how}), device {eff.source}", fit={"rows": rows})


def _split(m: Measurement, terms: tuple[float, float, float]) -> tuple[float, float] | None:
    """(scale, host per call) of one layout from its counted step: the busy time less the modelled communication
    is kernels and host time in the proportion that step measured (a ratio within one step: the machine's load
    cancels); the kernels' part over the modelled kernels is the scale."""
    compute, host_unit, comm = terms
    if not m.kernels or host_unit <= 0 or compute <= 0:
        return None
    k = m.kernels
    kernels = k["matmul"] + k["attention"] + k["elementwise"]
    ratio = max(0.0, (m.seconds - kernels - k.get("comm", 0.0) - comm) / kernels)
    scale = (m.seconds - comm) / (compute * (1 + ratio))
    return scale, ratio * scale * compute / host_unit


def _model_seconds(m: Measurement, device: Device, eff: Efficiency, gpus_per_node: int) -> float:
    """The plan's time for a measured layout, in the measurement's clock (busy time leaves out pipeline idle)."""
    from meshforge.planning.plan import plan

    t = plan(m.cfg, m.world_size, device, gpus_per_node, efficiency=eff).time
    return t.busy_s if m.clock == "busy" else t.step_s


def _terms(m: Measurement, device: Device, eff: Efficiency, gpus_per_node: int) -> tuple[float, float, float]:
    """(compute at scale 1, host time at 1 s per call, the rest) of a layout's modelled time: the time is linear
    in the scale and the host time on a device that does not overlap them."""
    unit = dataclasses.replace(eff, compute_scale=1.0, host_s_per_call=0.0)
    base = _model_seconds(m, device, unit, gpus_per_node)
    scaled = _model_seconds(m, device, dataclasses.replace(unit, compute_scale=2.0), gpus_per_node)
    host = _model_seconds(m, device, dataclasses.replace(unit, host_s_per_call=1.0), gpus_per_node) - base
    compute = scaled - base
    return compute, host, base - compute


def _apart(terms: list[tuple[float, float, float]]) -> bool:
    """Do the layouts' compute-to-host-call ratios differ enough (2x) to fit both?"""
    ratios = [a / h for a, h, _x in terms if h > 0]
    return len(ratios) >= 2 and max(ratios) >= 2 * min(ratios)


def _solve(terms: list[tuple[float, float, float]], ys: list[float], fit_scale: bool, fit_host: bool
           ) -> tuple[float, float]:
    """(scale, host per call) minimising sum(((s*a + h*c + x) / y - 1)^2) over the fitted ones (the other at 1 or
    0); a fit that would need a negative value is refused with the reason."""
    w = [1 / y**2 for y in ys]
    r = [y - x for (_a, _c, x), y in zip(terms, ys)]
    if fit_scale and fit_host:
        saa = sum(wi * a * a for wi, (a, _c, _x) in zip(w, terms))
        sac = sum(wi * a * c for wi, (a, c, _x) in zip(w, terms))
        scc = sum(wi * c * c for wi, (_a, c, _x) in zip(w, terms))
        sar = sum(wi * a * ri for wi, (a, _c, _x), ri in zip(w, terms, r))
        scr = sum(wi * c * ri for wi, (_a, c, _x), ri in zip(w, terms, r))
        det = saa * scc - sac * sac
        if det > 0:
            s, h = (sar * scc - scr * sac) / det, (saa * scr - sac * sar) / det
            if s > 0 and h >= 0:
                return s, h
        fit_host = False  # the layouts do not tell them apart: a scale alone
    if fit_host:
        r2 = [ri - a for (a, _c, _x), ri in zip(terms, r)]
        num = sum(wi * c * ri for wi, (_a, c, _x), ri in zip(w, terms, r2))
        den = sum(wi * c * c for wi, (_a, c, _x) in zip(w, terms))
        if den > 0 and num >= 0:
            return 1.0, num / den
        # the measured time is below the modelled kernels: the kernels' rates are what is off
    num = sum(wi * a * ri for wi, (a, _c, _x), ri in zip(w, terms, r))
    den = sum(wi * a * a for wi, (a, _c, _x) in zip(w, terms))
    if den <= 0 or num <= 0:
        raise CalibrationError("the measured step times are shorter than the modelled communication alone: "
                               "the device's links are too slow in the model (check --gpu / --link)")
    return num / den, 0.0


# ------------------------------------------------------------------------------------------ the file
def save(path: str | Path, device: Device, eff: Efficiency) -> Path:
    p = Path(path)
    p.write_text(json.dumps({"device": dataclasses.asdict(device), "efficiency": eff.to_dict(), "fit": eff.fit},
                            indent=1))
    return p


def load(path: str | Path) -> tuple[Device, Efficiency]:
    """(device, efficiencies) of an efficiency file; one line on anything unusable."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"--efficiency {path}: no such file (write one with `meshforge plan --calibrate "
                               "RUN_DIR`)")
    data = _load(p)
    try:
        dev = Device(**data["device"])
        eff = Efficiency.from_dict(data["efficiency"])
    except (KeyError, TypeError, ValueError) as err:
        raise CalibrationError(f"--efficiency {path}: not an efficiency file ({type(err).__name__}: {err})") from None
    links = ("nvlink_gbps", "fabric_gbps")  # 0: not measured (a one-process bench)
    bad = [k for k, v in dataclasses.asdict(dev).items() if isinstance(v, float) and not math.isfinite(v)
           or isinstance(v, float) and (v < 0 if k in links else v <= 0)]
    if bad or not 0 < eff.compute_scale < math.inf:
        raise CalibrationError(f"--efficiency {path}: {', '.join(bad) or 'compute_scale'} must be positive and finite")
    return dev, dataclasses.replace(eff, source=f"{eff.source} [file {p}]", fit=data.get("fit", {}))
