"""The parity harness: run many configs on N gloo CPU processes in ONE launch, compare with one process.

Process start costs ~3 s, a tiny run milliseconds, so configurations are run many per launch
(`configs_job` inside a shared launch of `testing.group`, or `run_configs` for a launch of its own). The
single-process reference runs in the calling process (`run_single`). Both return per-step losses, grad
norms and the final full (gathered) weights, so a test compares them with an explicit tolerance (`compare`)
and prints the worst difference.

Configs are override lists applied to `base_overrides()`: a tiny fp32 model on synthetic data, 10 steps.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from meshforge.config import load_config
from meshforge.distributed.env import DistInfo
from meshforge.testing.group import Job, launch_jobs
from meshforge.training.trainer import train


def base_overrides(steps: int = 10) -> list[str]:
    return ["model.preset=tiny", "data.source=synthetic", f"training.max_steps={steps}", "training.seq_len=32",
            "training.global_batch_size=8", "training.micro_batch_size=2", "training.device=cpu",
            "training.precision=fp32", "logging.progress=none", "logging.loggers=[]", "checkpoint.resume=none",
            "optimizer.lr=1e-2", "scheduler.warmup_steps=2", "run.seed=7"]


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None


def config(overrides: list[str], steps: int = 10, world_size: int | None = None):
    """`base_overrides(steps)` + overrides, validated at this process's world size."""
    ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    return load_config(None, base_overrides(steps) + list(overrides), world_size=ws)


def single_info() -> DistInfo:
    return DistInfo(0, 1, 0, torch.device("cpu"), None)


def run_single(overrides: list[str] = (), steps: int = 10, weights: bool = True) -> RunResult:
    """The single-process reference, in this process (world size 1). `distributed.*` overrides are dropped."""
    cfg = config([o for o in overrides if not o.startswith("distributed.")], steps, world_size=1)
    res = train(cfg, single_info())
    return RunResult(res.losses, res.grad_norms, res.parallel_model.full_state_dict() if weights else {})


def run_in_group(overrides: list[str], steps: int, info: DistInfo, weights: bool = True) -> dict:
    """One config inside an existing process group: {losses, grad_norms[, weights on rank 0]}."""
    res = train(config(overrides, steps, info.world_size), info)
    out: dict = {"losses": res.losses, "grad_norms": res.grad_norms}
    if weights:
        w = res.parallel_model.full_state_dict()  # every rank takes part in the gathers
        if info.rank == 0:
            out["weights"] = w
    return out


def configs_job(spec: dict, info: DistInfo) -> dict[str, dict]:
    """Job target (`testing.group`): every config of `spec["configs"]` in this process group, as
    {name: {losses, grad_norms, weights (rank 0)}} or {name: {error}}."""
    results = {}
    for name, overrides in spec["configs"].items():
        # a fresh compile cache per config: configs compiled earlier in this process would otherwise use up
        # dynamo's recompile limit, and a compiled config would silently run eagerly
        torch._dynamo.reset()
        try:
            results[name] = run_in_group(overrides, spec.get("steps", 10), info, spec.get("weights", True))
        except (Exception, CheckpointException) as err:  # reported to the test, which fails with it
            results[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
    return results


def results_of(raw: dict[str, dict]) -> dict[str, RunResult]:
    """`configs_job`'s value -> RunResults by name."""
    return {name: RunResult([], [], {}, r["error"]) if "error" in r else
            RunResult(r["losses"], r["grad_norms"], r.get("weights", {})) for name, r in raw.items()}


def run_configs(configs: dict[str, list[str]], nproc: int, steps: int = 10, weights: bool = True,
                timeout: float = 900) -> dict[str, RunResult]:
    """Launch `nproc` gloo processes once and run each named override list; rank 0's view is returned."""
    job = Job("configs", "meshforge.testing.parity:configs_job", {"configs": configs, "steps": steps,
                                                                   "weights": weights}, nproc)
    out = launch_jobs([job], nproc, timeout=timeout)["configs"]
    if "error" in out:
        raise RuntimeError(out["error"])
    return results_of(out["value"])


def compare(ref: RunResult, got: RunResult, name: str = "", loss_rtol: float = 1e-5,
            weight_atol: float | None = None, grad_norm_rtol: float = 1e-4) -> tuple[float, float]:
    """Assert parity; returns (max relative loss difference, max abs weight difference) and prints them."""
    assert got.error is None, f"{name} failed:\n{got.error}"
    assert len(ref.losses) == len(got.losses), f"{name}: {len(got.losses)} steps vs {len(ref.losses)}"
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, got.losses))
    wdiff = 0.0
    if weight_atol is not None:
        assert set(ref.weights) == set(got.weights), \
            f"{name}: parameter names differ: {sorted(set(ref.weights) ^ set(got.weights))[:6]}"
        for k in ref.weights:
            wdiff = max(wdiff, (ref.weights[k] - got.weights[k]).abs().max().item())
    gn = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.grad_norms, got.grad_norms)), default=0.0)
    print(f"parity {name}: max rel loss diff {rel:.3e}, max abs weight diff {wdiff:.3e}, "
          f"max rel grad-norm diff {gn:.3e}")
    # the logged (and clipping) grad norm must be the global one, however the grads are sharded
    assert gn <= grad_norm_rtol, \
        f"{name}: grad norm differs by {gn:.3e} relative (ref {ref.grad_norms}, got {got.grad_norms})"
    assert rel <= loss_rtol, f"{name}: relative loss difference {rel:.3e} > {loss_rtol} " \
                             f"(ref {ref.losses}, got {got.losses})"
    if weight_atol is not None:
        assert wdiff <= weight_atol, f"{name}: final weights differ by {wdiff:.3e} > {weight_atol}"
    return rel, wdiff
