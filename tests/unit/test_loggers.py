"""Experiment tracking and profiling, against the real libraries: one tiny run logs to jsonl, TensorBoard,
W&B (offline) and MLflow (local file store) and profiles two steps; each store is read back with the
library's own reader (W&B's offline run file with its protobuf records) and must hold every logged step's
metrics, the resolved config and the run metadata, and the generated samples (`logging.samples`: a text table in
TensorBoard, a W&B table, an MLflow JSON artifact). Plus: the old logging booleans map exactly onto
`logging.loggers`, a missing extra is one line, a CUDA memory snapshot on CPU is refused in one line."""

from __future__ import annotations

import glob
import json
import struct

import pytest

from meshforge.config import load_config
from meshforge.errors import ConfigError
from meshforge.testing.parity import base_overrides, single_info
from meshforge.training.trainer import train

STEPS = 4
# greedy text from the live model at steps 2 and 4 (byte-level: data.source=text)
SAMPLES = ["data.source=text", "data.max_files=2",
           "logging.samples={prompts: ['def f', 'x|y'], every: 2, max_new_tokens: 5}"]


def _wandb_records(run_dir: str) -> list:
    """The protobuf records of a W&B offline run file (a leveldb-style log: 7-byte header, 32 KiB blocks of
    chunks, each `crc32 u32, length u16, type u8` + data; type 1 = a whole record, 2/3/4 = first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, recs, buf = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        buf += raw[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            recs.append(rec)
            buf = b""
    return recs


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tracked") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, base_overrides(STEPS) + [
        f"run.output_dir={out}", "run.name=tracked", "logging.log_every=1", "logging.project=mf-test",
        "logging.loggers=[jsonl,tensorboard,wandb,mlflow]", "profiling.enabled=true", "profiling.steps=[2,3]",
        *SAMPLES],
        world_size=1)
    try:
        res = train(cfg, single_info())
    finally:
        mp.undo()
    return out, res


@pytest.mark.slow  # the tracked run: real tensorboard, wandb, mlflow and the profiler, seconds of its own
def test_jsonl_and_metadata(tracked_run):
    out, res = tracked_run
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in recs if "samples" in r] == res.samples and [r["step"] for r in res.samples] == [2, 4]
    assert [s["prompt"] for s in res.samples[0]["samples"]] == ["def f", "x|y"]
    recs = [r for r in recs if "samples" not in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == res.losses
    meta = json.loads((out / "run_meta.json").read_text())
    assert meta["config"]["logging"]["loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert meta["config"]["training"]["max_steps"] == STEPS
    m = meta["meta"]
    assert m["world_size"] == 1 and m["strategy"] == "fsdp2" and m["layout"]["tp"] == 1
    assert m["torch_version"] and m["meshforge_version"] and "git_commit" in m


@pytest.mark.slow  # the tracked run: real tensorboard, wandb, mlflow and the profiler, seconds of its own
def test_tensorboard(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, res = tracked_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, STEPS + 1))
    assert [e.value for e in losses] == pytest.approx(res.losses, rel=1e-6)
    assert {"grad_norm", "lr", "tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert "mfu" not in acc.Tags()["scalars"]  # None on CPU: not logged as a number
    texts = acc.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [2, 4]
    table = texts[-1].tensor_proto.string_val[0].decode()
    last = res.samples[-1]["samples"]
    assert table.startswith("| prompt | completion |") and "x\\|y" in table
    assert last[0]["completion"].replace("\n", "<br>").replace("|", "\\|") in table


@pytest.mark.slow  # the tracked run: real tensorboard, wandb, mlflow and the profiler, seconds of its own
def test_wandb_offline(tracked_run):
    out, res = tracked_run
    recs = _wandb_records(str(out))
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in recs if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in history] == pytest.approx(res.losses, rel=1e-6)
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert run.project == "mf-test" and run.display_name == "tracked"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["training"]["max_steps"] == STEPS and config["meta"]["world_size"] == 1
    tables = [{i.nested_key[1]: json.loads(i.value_json) for i in r.history.item if i.nested_key[:1] == ["samples"]}
              for r in recs if r.WhichOneof("record_type") == "history"]
    tables = [t for t in tables if t]  # (the rows of steps 2 and 4)
    assert [t["_type"] for t in tables] == ["table-file", "table-file"] and tables[-1]["nrows"] == 2


@pytest.mark.slow  # the tracked run: real tensorboard, wandb, mlflow and the profiler, seconds of its own
def test_mlflow_local_store(tracked_run):
    from mlflow.tracking import MlflowClient

    out, res = tracked_run
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("mf-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in hist) == [(s + 1, pytest.approx(v)) for s, v in enumerate(res.losses)]
    assert run.data.params["training.max_steps"] == str(STEPS)
    assert run.data.params["logging.loggers"] == json.dumps(["jsonl", "tensorboard", "wandb", "mlflow"])
    assert run.data.tags["meshforge.world_size"] == "1"
    art = client.download_artifacts(run.info.run_id, "config.json", str(out / "dl"))
    assert json.loads(open(art).read())["config"]["run"]["name"] == "tracked"
    art = client.download_artifacts(run.info.run_id, "samples/step_000004.json", str(out / "dl"))
    assert json.loads(open(art).read()) == res.samples[-1]


@pytest.mark.slow  # the tracked run: real tensorboard, wandb, mlflow and the profiler, seconds of its own
def test_profiler_trace_has_step_markers(tracked_run):
    out, _ = tracked_run
    trace = json.loads((out / "profile" / "trace_rank0.json").read_text())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # exactly the window, numbered by the run's steps
    ops = {e.get("name") for e in trace["traceEvents"]}
    assert any(o and o.startswith("aten::") for o in ops)  # real operator events inside


@pytest.mark.parametrize("old, want", [
    (["logging.jsonl=false"], []),
    (["logging.tensorboard=true"], ["jsonl", "tensorboard"]),
    (["logging.loggers=[wandb]", "logging.jsonl=true"], ["wandb", "jsonl"]),
    (["logging.loggers=[tensorboard]", "logging.jsonl=false"], ["tensorboard"]),
    (["logging.loggers=[jsonl,tensorboard]", "logging.tensorboard=true"], ["jsonl", "tensorboard"]),
    ([], ["jsonl"]),
])
def test_old_logging_booleans_map_exactly(old, want):
    cfg = load_config(None, old)
    assert cfg.logging.loggers == want
    assert "tensorboard" not in cfg.logging.model_dump() and "jsonl" not in cfg.logging.model_dump()


def test_bad_logger_values_are_one_line():
    for bad, key in ((["logging.loggers=[neptune]"], "logging.loggers"), (["logging.tensorboard=maybe"],
                     "logging.tensorboard"), (["logging.loggers=[jsonl]", "logging.jsonl=false"], "contradicts")):
        with pytest.raises(ConfigError) as err:
            load_config(None, bad)
        assert len(err.value.problems) == 1 and key in err.value.problems[0], err.value.problems


def test_missing_extra_is_one_line(monkeypatch):
    import importlib.util

    from meshforge.training import loggers

    real = importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError) as err:
        loggers.check_extras(["jsonl", "wandb", "mlflow"])
    assert err.value.problems == ["logging.loggers includes wandb, which needs the wandb extra: "
                                  "pip install 'meshforge[wandb]'"]


def test_memory_snapshot_needs_cuda(tmp_path):
    import torch

    from meshforge.training.profiling import StepProfiler

    with pytest.raises(ConfigError) as err:  # the rule, before any process starts
        load_config(None, ["training.device=cpu", "profiling.enabled=true", "profiling.memory_snapshot=true"])
    assert "needs CUDA" in err.value.problems[0] and len(err.value.problems) == 1
    cfg = load_config(None, ["training.device=auto", "profiling.enabled=true", "profiling.memory_snapshot=true"])
    with pytest.raises(ConfigError, match="profiling.memory_snapshot=true needs CUDA"):
        StepProfiler(cfg.profiling, str(tmp_path), 0, torch.device("cpu"))
    with pytest.raises(ConfigError, match="profiling.steps"):
        load_config(None, ["profiling.enabled=true", "profiling.steps=[4,2]"])
    with pytest.raises(ConfigError, match="ends after training.max_steps"):
        load_config(None, ["profiling.enabled=true", "profiling.steps=[4,20]", "training.max_steps=10"])


def test_a_logger_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # MLflow 3 then refuses its file store
    cfg = load_config(None, base_overrides(2) + [f"run.output_dir={tmp_path}", "logging.loggers=[mlflow]"],
                      world_size=1)
    with pytest.raises(ConfigError) as err:
        train(cfg, single_info())
    assert len(err.value.problems) == 1 and "logging.loggers includes mlflow but its store" in err.value.problems[0]


def test_tracking_keys_nothing_reads_are_warned():
    from meshforge.config.rules import warnings

    cfg = load_config(None, ["profiling.steps=[1,2]", "logging.project=x", "logging.mlflow_tracking_uri=file:/m"])
    assert warnings(cfg, 1) == ["profiling.steps is ignored because profiling.enabled=false",
                                "logging.project is ignored: logging.loggers ['jsonl'] has no mlflow or wandb",
                                "logging.mlflow_tracking_uri is ignored: logging.loggers ['jsonl'] has no mlflow"]
    cfg = load_config(None, ["profiling.enabled=true", "profiling.steps=[1,2]", "logging.loggers=[mlflow]",
                             "logging.project=x", "logging.mlflow_tracking_uri=file:/m"])
    assert warnings(cfg, 1) == []
