"""Where metrics go: a rich progress bar (TTY) or plain lines, and the sinks of `logging.loggers` (loggers.py)."""

from __future__ import annotations

import math
import sys

from meshforge.training.loggers import build_loggers, check_extras, run_metadata


def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


class MetricsLogger:
    def __init__(self, output_dir: str, lcfg, max_steps: int, enabled: bool, start_step: int = 0,
                 run_name: str = "meshforge"):
        check_extras(lcfg.loggers)  # on every rank: the same one line everywhere
        self.enabled = enabled
        self.sinks = []
        self.progress = None
        if not enabled:
            return
        mode = lcfg.progress
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.sinks = build_loggers(lcfg, output_dir, run_name, resume=start_step > 0)
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self.task = self.progress.add_task("train", total=max_steps, completed=start_step, info="")
            self.progress.start()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        for sink in self.sinks:
            sink.log(record)
        line = " ".join(f"{k}={_fmt(record.get(k))}" for k in
                        ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "max_mem_gib"))
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], info=f"loss {record['loss']:.4f}")
        elif self.mode == "plain":
            print(line, flush=True)

    def start(self, cfg, **world) -> None:
        """The resolved config and the run's metadata (with `world`: its size, layout, device), once (rank 0)."""
        if not self.sinks:
            return
        config = cfg.model_dump(mode="json", exclude={"dist", "ddp"})
        meta = run_metadata({"strategy": cfg.distributed.strategy, **world})
        for sink in self.sinks:
            sink.start(config, meta)

    def info(self, msg: str) -> None:
        if self.enabled:
            if self.progress is not None:
                self.progress.console.print(msg)
            else:
                print(msg, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        for sink in self.sinks:
            sink.close()
