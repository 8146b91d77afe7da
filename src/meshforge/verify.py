"""`meshforge verify`: a short training run of every registered strategy on N local processes, one line each.

The spec's verification in our terms: every run ends with a finite loss at its last step. The strategies
(built-in, or registered by a plugin, `config/strategies/`) run one after another in ONE launch of N
processes (`meshforge.testing.group`), each a full `train()` of the tiny model on synthetic data with its
own trainer, so a failing strategy is reported on its line and the others still run.
"""

from __future__ import annotations

import math
import sys
import tempfile

from meshforge.config import load_config
from meshforge.config.strategies import strategy_specs
from meshforge.distributed.env import DistInfo
from meshforge.testing.group import Job, launch_jobs
from meshforge.training.trainer import train


def overrides(strategy: str, nproc: int, steps: int, out_dir: str) -> list[str]:
    return [f"distributed.strategy={strategy}", f"training.max_steps={steps}", "model.preset=tiny",
            "data.source=synthetic", "training.seq_len=32", f"training.global_batch_size={2 * nproc}",
            "training.micro_batch_size=1", "logging.log_every=1", "logging.progress=none", "logging.jsonl=false",
            f"run.output_dir={out_dir}", "checkpoint.resume=none", "training.device=cpu"]


def run_strategy(spec: dict, info: DistInfo) -> list[float]:
    """Job target: one strategy's short run; its per-step losses."""
    cfg = load_config(None, overrides(spec["strategy"], info.world_size, spec["steps"], spec["out_dir"]),
                      world_size=info.world_size)
    return train(cfg, info).losses


def verify(nproc: int, steps: int = 5) -> int:
    with tempfile.TemporaryDirectory(prefix="meshforge-verify-") as tmp:
        jobs = [Job(name, "meshforge.verify:run_strategy", {"strategy": name, "steps": steps,
                                                            "out_dir": f"{tmp}/{name}"}, nproc)
                for name in strategy_specs()]
        try:
            outcomes = launch_jobs(jobs, nproc, timeout=600 + 120 * len(jobs))
        except RuntimeError as err:  # the launch itself failed (no process group): every strategy fails
            first = (str(err).strip().splitlines() or ["no output"])[0]
            outcomes = {job.name: {"error": first} for job in jobs}
    failures = 0
    for name, out in outcomes.items():
        losses = out.get("value") or []
        if "error" not in out and len(losses) == steps and all(math.isfinite(x) for x in losses):
            print(f"{name:14s} PASS  {nproc} processes, {steps} steps, last loss {losses[-1]:.4f}")
        else:
            failures += 1
            why = out.get("error", f"losses {losses}").strip().splitlines()[0]
            print(f"{name:14s} FAIL  {why}")
    sys.stdout.flush()
    return 1 if failures else 0
