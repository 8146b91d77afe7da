"""Where metrics go: a rich progress bar (TTY) or plain lines, and the sinks of `logging.loggers` (loggers.py)."""

from __future__ import annotations

import math
import sys

from meshforge.checkpoint.collectives import all_gather_object
from meshforge.config.schema import BRIDGE_SECTIONS
from meshforge.errors import ConfigError
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
        self.sink_args = (lcfg, output_dir, run_name, start_step)  # the sinks are built by `start`
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
        if "samples" in record:  # generated text (training/samples.py)
            for sample in record["samples"]:
                self.info(f"step={record['step']} sample {sample['prompt']!r} -> {sample['completion']!r}")
            return
        if "val_loss" in record:  # a validation record (training/validation.py)
            self.info(" ".join(f"{k}={_fmt(record.get(k))}" for k in ("step", "val_loss", "val_ppl")) +
                      "".join(f" {k}={_fmt(v)}" for k, v in record.items() if k.startswith("val_loss/")))
            return
        line = " ".join(f"{k}={_fmt(record.get(k))}" for k in
                        ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "max_mem_gib"))
        if "slowest_rank" in record:  # more than one rank (stragglers.py)
            line += f" slowest_rank={record['slowest_rank']} slowest_ratio={record['slowest_ratio']:.2f}"
        if self.progress is not None:
            slow = f" slowest rank {record['slowest_rank']} x{record['slowest_ratio']:.2f}" \
                if "slowest_rank" in record else ""
            self.progress.update(self.task, completed=record["step"], info=f"loss {record['loss']:.4f}{slow}")
        elif self.mode == "plain":
            print(line, flush=True)

    def start(self, cfg, **world) -> None:
        """Build the sinks (rank 0) and give them the resolved config and the run's metadata (with `world`: its
        size, layout, device) once. Every rank learns whether that worked, so a sink that cannot start (W&B not
        logged in, an MLflow store that refuses) is one line on every rank, not rank 0 dying while the others
        wait in a collective."""
        error = None
        if self.enabled:
            try:
                self.sinks = build_loggers(*self.sink_args)
                config = cfg.model_dump(mode="json", exclude=BRIDGE_SECTIONS)
                meta = run_metadata({"strategy": cfg.distributed.strategy, **world}) if self.sinks else {}
                for sink in self.sinks:
                    sink.start(config, meta)
            except ConfigError as err:
                error = "; ".join(err.problems)
            except Exception as err:  # noqa: BLE001 - any library's failure becomes the one line below
                first = (str(err).strip().splitlines() or [""])[0][:200]
                error = f"logging.loggers: a logger could not start ({type(err).__name__}: {first})"
        error = next((e for e in all_gather_object(error) if e), None)  # every rank stops, or none
        if error:
            self.close()
            raise ConfigError([error])

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
