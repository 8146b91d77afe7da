"""Tracking and profiling on 2 ranks (in the shared N=2 launch): every rank writes its own trace with the
profiled steps' markers; only rank 0 logs (one metrics line per step, one TensorBoard run, not two)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshforge.testing.group import Job

pytestmark = pytest.mark.dist

OUT = Path(os.environ["MESHFORGE_TEST_SHARED"]) / "tracking"


def tracking_job(spec, info) -> dict:
    import torch.distributed as dist

    from meshforge.testing.parity import config
    from meshforge.training.trainer import train

    overrides = [f"run.output_dir={OUT}", "logging.loggers=[tensorboard,jsonl]", "logging.log_every=1",
                 "profiling.enabled=true", "profiling.steps=[2,3]"]
    res = train(config(overrides, steps=3, world_size=info.world_size), info)
    dist.barrier()  # every rank's trace is written before rank 0 looks
    traces = {}
    for path in sorted((OUT / "profile").glob("trace_rank*.json")):
        events = json.loads(path.read_text())["traceEvents"]
        traces[path.name] = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    return {"losses": res.losses, "traces": traces,
            "metrics_lines": len((OUT / "metrics.jsonl").read_text().splitlines()),
            "tb_files": len(list((OUT / "tensorboard").glob("events.*")))}


GROUP_JOBS = [Job("tracking n2", f"{Path(__file__).resolve()}:tracking_job", None, 2)]


def test_trace_per_rank_and_rank0_logs_once(group):
    out = group("tracking n2")
    assert out["traces"] == {f"trace_rank{r}.json": ["ProfilerStep#2", "ProfilerStep#3"] for r in (0, 1)}
    assert out["metrics_lines"] == 3 and out["tb_files"] == 1 and len(out["losses"]) == 3
