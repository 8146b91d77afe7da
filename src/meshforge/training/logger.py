"""Where metrics go: a rich progress bar (TTY) or plain lines, metrics.jsonl, and optional TensorBoard."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


class MetricsLogger:
    def __init__(self, output_dir: str | None, lcfg, max_steps: int, enabled: bool, start_step: int = 0):
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        self.progress = None
        if not enabled:
            return
        mode = lcfg.progress
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        if output_dir and lcfg.jsonl:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            self.jsonl = open(Path(output_dir) / "metrics.jsonl", "a" if start_step else "w")
        if lcfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("logging.tensorboard=true needs the tensorboard extra: "
                                   "pip install 'meshforge[tensorboard]'") from err
            self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task("train", total=max_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, record["step"])
        if "val_loss" in record:  # a validation record (training/validation.py)
            self.info(" ".join(f"{k}={_fmt(record.get(k))}" for k in ("step", "val_loss", "val_ppl")))
            return
        line = " ".join(f"{k}={_fmt(record.get(k))}" for k in
                        ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "max_mem_gib"))
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], info=f"loss {record['loss']:.4f}")
        elif self.mode == "plain":
            print(line, flush=True)

    def info(self, msg: str) -> None:
        if self.enabled:
            if self.progress is not None:
                self.progress.console.print(msg)
            else:
                print(msg, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
