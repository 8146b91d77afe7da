"""Metric sinks behind one small interface: jsonl, TensorBoard, Weights & Biases, MLflow (`logging.loggers`).

A `RunLogger` gets the resolved config and the run's metadata once (`start`), a record per logged step
(`log`: {"step", "loss", ...}; None values are skipped by sinks that cannot store them), and `close`. Only
rank 0 builds loggers (`build_loggers`); every rank calls `check_extras` first, so a missing optional library
is the same one line on every rank (exit 2) rather than rank 0 dying while the others wait in a collective.

- jsonl: `<output_dir>/metrics.jsonl` (one object per logged step) and `run_meta.json`. A resume at step S keeps
  the records up to S and drops the later ones (the steps a crash lost, which the resumed run logs again), so
  a crash-and-resume timeline has no repeated step.
- tensorboard: scalars under `<output_dir>/tensorboard`; the config and metadata as text. A resume at step S
  purges the events after S the same way (SummaryWriter's `purge_step`).
- wandb: project `logging.project`, run `run.name`, files under `<output_dir>/wandb`; set `WANDB_MODE=offline`
  where there is no network (W&B's own variables are honoured).
- mlflow: experiment `logging.project`, run `run.name`; params = the flattened config, tags = the metadata,
  `config.json` as an artifact; the store is `logging.mlflow_tracking_uri`, else `$MLFLOW_TRACKING_URI`, else
  the local file store `<output_dir>/mlruns` (MLflow 3 wants `MLFLOW_ALLOW_FILE_STORE=true` for a file store:
  meshforge sets it unless you did).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from meshforge.errors import ConfigError

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
          "mlflow": ("mlflow", "mlflow")}  # logger -> (module it imports, meshforge extra)


def check_extras(names: list[str]) -> None:
    """One line per chosen logger whose library is not installed."""
    missing = [f"logging.loggers includes {n}, which needs the {EXTRAS[n][1]} extra: "
               f"pip install 'meshforge[{EXTRAS[n][1]}]'"
               for n in names if n in EXTRAS and importlib.util.find_spec(EXTRAS[n][0]) is None]
    if missing:
        raise ConfigError(missing)


def run_metadata(world: dict[str, Any]) -> dict[str, Any]:
    """What a run was: git commit (of the working directory, if it is a repository), versions, host, and the
    `world` the caller describes (world size, layout, strategy, device)."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("meshforge")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
        version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"git_commit": commit, "meshforge_version": version, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "cuda_version": torch.version.cuda,
            "hostname": platform.node(), "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get(
                "SLURM_NNODES", 1))),
            "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **world}


def _scalars(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def samples_markdown(samples: list[dict]) -> str:
    """A markdown table of generated samples (TensorBoard renders its text as markdown)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    return "| prompt | completion |\n|---|---|\n" + "\n".join(
        f"| {cell(s['prompt'])} | {cell(s['completion'])} |" for s in samples)


def _flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class RunLogger:
    """The interface: `start` once, `log` per logged step, `close` at the end. A record with `samples` (generated
    text, training/samples.py: [{prompt, completion}]) is text, which each sink stores its own way."""

    def start(self, config: dict, meta: dict) -> None: ...

    def log(self, record: dict) -> None: ...

    def close(self) -> None: ...


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) else None


class JsonlLogger(RunLogger):
    def __init__(self, output_dir: str, start_step: int):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        if start_step > 0 and path.is_file():  # keep the timeline up to the resumed step, whole lines only
            kept = [ln for ln in path.read_text(errors="replace").splitlines(keepends=True)
                    if ln.endswith("\n") and (s := _step_of(ln)) is not None and s <= start_step]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)
        self.file = open(path, "a" if start_step > 0 else "w")

    def start(self, config: dict, meta: dict) -> None:
        (self.dir / "run_meta.json").write_text(json.dumps({"config": config, "meta": meta}, indent=1))

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger(RunLogger):
    def __init__(self, output_dir: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"),
                                    purge_step=start_step + 1 if start_step > 0 else None)

    def start(self, config: dict, meta: dict) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")
        self.writer.add_text("meta", "```\n" + json.dumps(meta, indent=1) + "\n```")

    def log(self, record: dict) -> None:
        if "samples" in record:
            self.writer.add_text("samples", samples_markdown(record["samples"]), record["step"])
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLogger(RunLogger):
    def __init__(self, output_dir: str, project: str, name: str):
        self.output_dir, self.project, self.name, self.run = output_dir, project, name, None

    def start(self, config: dict, meta: dict) -> None:
        import wandb

        Path(self.output_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, name=self.name, dir=self.output_dir,
                              config={**config, "meta": meta}, reinit="create_new")

    def log(self, record: dict) -> None:
        if "samples" in record:
            import wandb

            rows = [[record["step"], s["prompt"], s["completion"]] for s in record["samples"]]
            self.run.log({"samples": wandb.Table(columns=["step", "prompt", "completion"], data=rows)},
                         step=record["step"])
            return
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class MLflowLogger(RunLogger):
    def __init__(self, output_dir: str, project: str, name: str, tracking_uri: str | None):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            Path(output_dir, "mlruns").resolve().as_uri()
        if "://" not in uri or uri.startswith("file:"):
            # MLflow 3 keeps its file store only behind this switch; a local file store is what we document
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri, self.client, self.project, self.name, self.run_id = uri, None, project, name, None

    def start(self, config: dict, meta: dict) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(self.uri)
            exp = self.client.get_experiment_by_name(self.project)
        except MlflowException as err:
            raise ConfigError([f"logging.loggers includes mlflow but its store {self.uri} cannot be opened: "
                               f"{str(err).splitlines()[0][:200]}"]) from None
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.project)
        self.run_id = self.client.create_run(exp_id, run_name=self.name).info.run_id
        params = [Param(k, v[:6000]) for k, v in _flatten(config).items()]
        tags = [RunTag(f"meshforge.{k}", json.dumps(v) if isinstance(v, dict) else str(v)) for k, v in meta.items()]
        self.client.log_batch(self.run_id, params=params, tags=tags)
        self.client.log_dict(self.run_id, {"config": config, "meta": meta}, "config.json")

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        if "samples" in record:  # one JSON table per logged step: samples/step_000010.json
            self.client.log_dict(self.run_id, {"step": record["step"], "samples": record["samples"]},
                                 f"samples/step_{record['step']:06d}.json")
            return
        ts = int(time.time() * 1000)
        metrics = [Metric(k, v, ts, record["step"]) for k, v in _scalars(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)


def build_loggers(lcfg, output_dir: str, run_name: str, start_step: int) -> list[RunLogger]:
    """The loggers `logging.loggers` names, in order (rank 0 only; call `check_extras` on every rank first);
    `start_step` > 0: a resume at that step."""
    out: list[RunLogger] = []
    for name in lcfg.loggers:
        if name == "jsonl":
            out.append(JsonlLogger(output_dir, start_step))
        elif name == "tensorboard":
            out.append(TensorBoardLogger(output_dir, start_step))
        elif name == "wandb":
            out.append(WandbLogger(output_dir, lcfg.project, run_name))
        elif name == "mlflow":
            out.append(MLflowLogger(output_dir, lcfg.project, run_name, lcfg.mlflow_tracking_uri))
    return out
