"""The parity harness: run several configs on N gloo CPU processes in ONE launch, return losses and weights.

Process start costs ~3 s, a tiny run milliseconds, so a test module launches once
(`run_configs`) and runs every configuration inside the same process group. The
single-process reference runs in the calling process (`run_single`). Both return
per-step losses and the final full (gathered) weights, so a test compares them
with an explicit tolerance and prints the worst difference.

Configs are given as override lists applied to `base_overrides()`: a tiny fp32
model on synthetic data, 10 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch


def base_overrides(steps: int = 10) -> list[str]:
    return ["model.preset=tiny", "data.source=synthetic", f"training.max_steps={steps}", "training.seq_len=32",
            "training.global_batch_size=8", "training.micro_batch_size=2", "training.device=cpu",
            "training.precision=fp32", "logging.progress=none", "logging.jsonl=false", "checkpoint.resume=none",
            "optimizer.lr=1e-2", "scheduler.warmup_steps=2", "run.seed=7"]


@dataclass
class RunResult:
    losses: list[float]
    grad_norms: list[float]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None


def full_weights(pm) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full CPU tensor, by the whole model's names (all ranks must call)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out: dict[str, torch.Tensor] = {}
    # cpu_offload=True would leave every rank but 0 empty, losing the other pipeline stages' weights
    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    for part in pm.unwrapped_parts() if len(pm.parts) > 1 else pm.parts:
        sd = part.state_dict_for_checkpoint() if hasattr(part, "state_dict_for_checkpoint") else \
            get_model_state_dict(part, options=opts)
        out.update({k: v.detach().float().cpu().clone() for k, v in sd.items()})
    if pm.mesh_ctx.pp_size > 1:  # stages hold different names: gather them all
        import torch.distributed as dist

        parts: list = [None] * pm.mesh_ctx.world_size
        dist.all_gather_object(parts, out)
        merged: dict[str, torch.Tensor] = {}
        for p in parts:
            merged.update(p or {})
        out = merged
    return out


def _cfg(overrides: list[str], steps: int):
    from meshforge.config import load_config

    return load_config(None, base_overrides(steps) + list(overrides),
                       world_size=int(os.environ.get("WORLD_SIZE", 1)))


def run_single(overrides: list[str] = (), steps: int = 10, weights: bool = True) -> RunResult:
    """The single-process reference, in this process (world size 1)."""
    from meshforge.distributed.env import DistInfo
    from meshforge.training.trainer import _train

    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        cfg = _cfg([o for o in overrides if not o.startswith("distributed.")], steps)
        res = _train(cfg, DistInfo(0, 1, 0, torch.device("cpu"), None))
        return RunResult(res.losses, res.grad_norms, full_weights(res.parallel_model) if weights else {})
    finally:
        os.environ.update(saved)


def _worker(spec_path: str, out_dir: str) -> None:
    """Entry point inside each launched process: run every config of the spec in one process group."""
    from meshforge.distributed.env import init_distributed
    from meshforge.training.trainer import _train

    spec = json.loads(Path(spec_path).read_text())
    info = init_distributed("cpu", timeout_minutes=spec.get("timeout_minutes", 5))
    results = {}
    for name, overrides in spec["configs"].items():
        try:
            cfg = _cfg(overrides, spec["steps"])
            res = _train(cfg, info)
            w = full_weights(res.parallel_model) if spec["weights"] else {}
            results[name] = {"losses": res.losses, "grad_norms": res.grad_norms}
            if info.rank == 0 and w:
                torch.save(w, Path(out_dir) / f"{name}.weights.pt")
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails with it
            import traceback

            results[name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
    if info.rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_configs(configs: dict[str, list[str]], nproc: int, steps: int = 10, weights: bool = True,
                timeout: float = 600) -> dict[str, RunResult]:
    """Launch `nproc` gloo processes once and run each named override list; rank 0's view is returned."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"configs": configs, "steps": steps, "weights": weights}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "meshforge.testing.parity", str(spec), tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        res_file = Path(tmp) / "results.json"
        if not res_file.exists():
            raise RuntimeError(f"parity launch failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                               f"{proc.stderr[-8000:]}")
        raw = json.loads(res_file.read_text())
        out = {}
        for name, r in raw.items():
            if "error" in r:
                out[name] = RunResult([], [], {}, r["error"])
                continue
            wf = Path(tmp) / f"{name}.weights.pt"
            out[name] = RunResult(r["losses"], r["grad_norms"],
                                  torch.load(wf, weights_only=True) if wf.exists() else {})
        return out


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


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
