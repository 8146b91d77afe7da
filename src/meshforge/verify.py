"""`meshforge verify`: a short run of every available strategy on N local processes, one line each.

The spec's verification in our terms: exit code 0, finite loss at the last step.
Each strategy runs in fresh processes through the same launcher `train` uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = ("ddp", "fsdp2", "megatron_fsdp")


def available_strategies() -> list[str]:
    import importlib.util

    return [s for s in STRATEGIES if s != "megatron_fsdp"
            or importlib.util.find_spec("meshforge.distributed.megatron_fsdp") is not None]


def verify(nproc: int, steps: int = 5) -> int:
    failures = 0
    for strategy in available_strategies():
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [f"distributed.strategy={strategy}", f"training.max_steps={steps}", "model.preset=tiny",
                         "data.source=synthetic", "training.seq_len=32", f"training.global_batch_size={2 * nproc}",
                         "training.micro_batch_size=1", "logging.log_every=1", "logging.progress=none",
                         f"run.output_dir={tmp}", "checkpoint.resume=none", "training.device=cpu"]
            cmd = [sys.executable, "-m", "meshforge", "train", "-", *overrides]
            cfg_path = Path(tmp) / "verify.yaml"
            cfg_path.write_text("run: {name: verify}\n")
            cmd[4] = str(cfg_path)
            if nproc > 1:
                cmd += ["--nproc-per-node", str(nproc)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            metrics = Path(tmp) / "metrics.jsonl"
            losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
            ok = proc.returncode == 0 and len(losses) == steps and all(abs(x) < float("inf") for x in losses)
            if ok:
                print(f"{strategy:14s} PASS  {nproc} processes, {steps} steps, last loss {losses[-1]:.4f}")
            else:
                failures += 1
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"{strategy:14s} FAIL  exit {proc.returncode}: {tail}")
    return 1 if failures else 0
