"""`meshforge bench` end to end on CPU/gloo: sweeps at N=1, 2 and 4.

Three commands, run once per module (5 launches in all): a strategy sweep at N=2 in one
launch (`--interleave`: every built-in strategy, and `allreduce_dp`, a strategy registered from
outside meshforge by `tests/plugin`, stepped in turn), a precision sweep at N=1 with the
bare-PyTorch baseline and the device profile (`--profile-device`, then `meshforge plan --calibrate`
on it), each configuration in fresh processes, and fsdp2 at N=4. Checks: files written and sane, positive throughput,
memory per rank falling with sharding as theory says, FSDP2's bytes per step equal
to ZeRO-3 theory for the tiny fp32 model, the plugin strategy training exactly
like ddp, and `meshforge plan`'s state bytes for the plugin (from the sharding it
declares in its spec) equal to what the bench measured on each rank.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from test_verify import PLUGIN, plugin_env

from meshforge.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = """model: {preset: tiny}
data: {source: synthetic}
training: {seq_len: 32, global_batch_size: 8, micro_batch_size: 2, device: cpu, precision: fp32}
checkpoint: {resume: none}
"""
FP32 = 4


def _bench(tmp_path_factory, name: str, args: list[str], env: dict | None = None) -> dict:
    d = tmp_path_factory.mktemp(name)
    cfg = d / "tiny.yaml"
    cfg.write_text(TINY)
    argv = ["bench", str(cfg), *args, "--steps", "2", "--warmup", "1", "--output-dir", str(d / "out")]
    if env is None:
        rc = main(argv)
    else:  # a separate process, where the plugin's entry point is found
        rc = subprocess.run([sys.executable, "-m", "meshforge", *argv], env=env, timeout=900).returncode
    out = d / "out"
    assert rc == 0, (out / "bench.json").read_text()[-20000:] if (out / "bench.json").exists() else rc
    res = json.loads((out / "bench.json").read_text())
    res["_dir"] = out
    return res


def _rows(res) -> dict[str, dict]:
    return {r["strategy"] if "strategy" in r else r["name"]: r for r in res["rows"]}


@pytest.fixture(scope="module")
def n2(tmp_path_factory):
    return _bench(tmp_path_factory, "n2", ["--nproc-per-node", "2", "--interleave", "--sweep",
                                           "distributed.strategy=ddp,fsdp2,megatron_fsdp,allreduce_dp"], plugin_env())


@pytest.fixture(scope="module")
def n1(tmp_path_factory):
    return _bench(tmp_path_factory, "n1", ["--sweep", "training.precision=fp32,bf16", "--baseline",
                                           "--baseline-rounds", "2", "--profile-device"])


@pytest.fixture(scope="module")
def n4(tmp_path_factory):
    return _bench(tmp_path_factory, "n4", ["distributed.strategy=fsdp2", "--nproc-per-node", "4"])


def _param_shapes():
    from meshforge.config.schema import ModelConfig
    from meshforge.models import build_model

    m = build_model(ModelConfig(preset="tiny"), device="meta")
    return m, {n: tuple(p.shape) for n, p in m.named_parameters()}


def _padded_bytes(shapes, n: int) -> int:
    """FSDP2 pads dim 0 of each parameter to a multiple of the shard count."""
    return sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) * FP32 for s in shapes)


def _sane(row):
    assert "error" not in row, row.get("error")
    assert row["step_s_median"] > 0 and row["tokens_per_s_per_device"] > 0 and row["tflops_per_device"] > 0
    assert row["mfu"] is None  # no CPU peak is invented
    assert len(row["step_s_all"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    assert row["tokens_per_s_per_device"] == pytest.approx(
        row["global_batch_size"] * row["seq_len"] / row["step_s_median"] / row["world_size"])


def _files(res, n_rows):
    out = res["_dir"]
    md = (out / "bench.md").read_text().splitlines()
    assert md[0].startswith("| config | N |") and len([x for x in md if x.startswith("| ")]) == n_rows + 1
    try:
        import matplotlib  # noqa: F401

        assert (out / "bench.png").stat().st_size > 1000
    except ImportError:
        assert not (out / "bench.png").exists()


def test_n2_strategy_sweep_memory_and_bytes(n2):
    rows = _rows(n2)
    _files(n2, len(rows))
    for r in rows.values():
        _sane(r)
        assert r["world_size"] == 2 and len(r["per_rank"]) == 2
    model, shapes = _param_shapes()
    p_bytes = sum(math.prod(s) for s in shapes.values()) * FP32
    ddp, fsdp2 = rows["ddp"], rows["fsdp2"]
    # memory per rank falls with sharding: ddp holds everything (+ its reducer buckets), fsdp2 half of it
    assert fsdp2["state_bytes_max"] < ddp["state_bytes_max"]
    d = ddp["per_rank"][0]["state_bytes"]
    assert (d["params"], d["grads"]) == (p_bytes, 2 * p_bytes)  # grads + DDP's bucket copy
    for rank in fsdp2["per_rank"]:
        s = rank["state_bytes"]
        assert s["params"] == s["grads"] == _padded_bytes(shapes.values(), 2) // 2
        assert s["optimizer"] == pytest.approx(p_bytes, abs=4 * len(shapes))  # exp_avg, exp_avg_sq + steps
    # FSDP2 bytes per step = ZeRO-3 theory: every micro batch gathers all params in forward and the
    # resharded blocks (all but the last; the root keeps its params) again in backward; one reduce-scatter
    accum = 8 // (2 * 2)
    blocks = [_padded_bytes([s for n, s in shapes.items() if n.startswith(f"layers.{i}.")], 2)
              for i in range(len(model.layers))]
    all_params = _padded_bytes(shapes.values(), 2)
    theory_ag = accum * (all_params + sum(blocks[:-1]))
    by_op = fsdp2["comm"]["by_op"]
    assert by_op["c10d::_allgather_base_"] == theory_ag, (by_op, theory_ag)
    assert by_op["c10d::_reduce_scatter_base_"] == all_params
    assert fsdp2["comm_bytes_per_step"] - theory_ag - all_params < 1024  # loss and grad-norm scalars
    # DDP: one all-reduce of every gradient (+ the loss)
    assert ddp["comm"]["by_op"]["c10d::allreduce_"] - p_bytes < 1024
    print(f"\nfsdp2 N=2 bytes/step {fsdp2['comm_bytes_per_step']} (theory {theory_ag + all_params} + scalars); "
          f"state/rank ddp {ddp['state_bytes_max']} fsdp2 {fsdp2['state_bytes_max']}")
    m = rows["megatron_fsdp"]  # optim_grads_params by default: ZeRO-3 like fsdp2
    assert m["state_bytes_max"] < ddp["state_bytes_max"]
    assert m["comm_bytes_per_step"] == pytest.approx(fsdp2["comm_bytes_per_step"], abs=1024)
    # the plugin strategy: full replicas like ddp (no reducer buckets), the same training, its own all-reduces
    a = rows["allreduce_dp"]
    assert a["per_rank"][0]["state_bytes"]["params"] == p_bytes
    assert a["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
    assert a["comm"]["by_op"]["c10d::allreduce_"] - p_bytes < 1024


def test_n2_plugin_plan_equals_the_bench(n2, monkeypatch):
    """The plugin declares its state (`DeclaredSharding(optimizer="owner")`: replicas, optimizer state ZeRO-1 style
    round the dp ranks); the plan's params, grads and optimizer bytes per rank, and its bytes per step, equal the
    bench's measurement."""
    from meshforge.config import load_config, strategies
    from meshforge.planning.comm import comm_per_step
    from meshforge.planning.layout import Layout
    from meshforge.planning.params import model_params
    from meshforge.planning.state import rank_state

    monkeypatch.syspath_prepend(str(PLUGIN))
    from meshforge_allreduce_dp import SPEC

    monkeypatch.setitem(strategies._SPECS, SPEC.name, SPEC)  # what its entry point does in the bench's processes
    row = _rows(n2)["allreduce_dp"]
    cfg = load_config(str(n2["_dir"].parent / "tiny.yaml"), row["overrides"], world_size=2)
    params, args = model_params(cfg)
    for r, measured in enumerate(row["per_rank"]):
        got = rank_state(params, cfg, Layout.from_sizes(2), r)
        want = measured["state_bytes"]
        assert (got.params, got.grads, got.optimizer) == (want["params"], want["grads"], want["optimizer"]), r
        print(f"\nallreduce_dp N=2 rank {r}: plan = bench: params {got.params}, grads {got.grads}, "
              f"optimizer {got.optimizer}")
    optimizer = [m["state_bytes"]["optimizer"] for m in row["per_rank"]]
    assert max(optimizer) < 0.6 * sum(optimizer)  # sharded: each rank holds about half the optimizer state
    # gradients all-reduced, owners broadcast the updated parameters, the loss and its token count
    assert sum(comm_per_step(params, args, cfg, Layout.from_sizes(2)).values()) == row["comm_bytes_per_step"]


def test_n1_precision_sweep_with_baseline(n1):
    rows = n1["rows"]
    assert [r["name"] for r in rows] == ["precision=fp32", "precision=bf16"]
    for r in rows:
        _sane(r)
        assert r["comm_bytes_per_step"] == 0 and r["world_size"] == 1
    assert rows[0]["state_bytes_max"] == rows[1]["state_bytes_max"]  # fp32 master weights either way
    base = n1["baseline"]
    assert "error" not in base, base.get("error")
    # the bare loop and meshforge start from the same weights on the same batch
    assert base["first_loss"]["bare"] == pytest.approx(base["first_loss"]["meshforge"], rel=1e-6)
    assert base["pairs"] == 4 and base["ratio"] > 0 and base["bare"]["tokens_per_s_per_device"] > 0
    md = (n1["_dir"] / "bench.md").read_text()
    assert "| bare PyTorch loop | 1 |" in md and "meshforge / bare PyTorch step time" in md
    _files(n1, 3)


def test_n1_profile_calibrates_a_cpu_device(n1, capsys):
    """`--profile-device` measures the CPU core (a matmul size curve, attention, the model's own elementwise
    kernels; process CPU time); `meshforge plan --calibrate` makes a device of it and fits the host time, and
    rows carry their busy time beside the wall time."""
    prof = n1["rows"][0]["device_profile"]
    assert prof["device"] == "cpu" and prof["clock"] == "process_cpu_time" and "collectives" not in prof
    assert len(prof["matmul"]) >= 12 and prof["kernels"]["elementwise_bytes"] > 0
    assert all(r["step_busy_s_median"] > 0 for r in n1["rows"])
    capsys.readouterr()
    assert main(["plan", "--calibrate", str(n1["_dir"])]) == 0
    out = capsys.readouterr().out
    assert "calibration on cpu" in out and "busy" in out
    saved = json.loads((n1["_dir"] / "efficiency.json").read_text())
    assert saved["device"]["name"] == "cpu" and saved["device"]["peak_tflops"] > 0
    assert [r["name"] for r in saved["fit"]["rows"]] == ["precision=fp32", "precision=bf16"]
    cfg = n1["_dir"].parent / "tiny.yaml"
    # one process measured no links: planning several devices with it is refused in one line
    assert main(["plan", str(cfg), "--world-size", "2", "--efficiency", str(n1["_dir"] / "efficiency.json")]) == 2
    assert "links were not measured" in capsys.readouterr().err
    assert main(["plan", str(cfg), "--world-size", "1", "--efficiency", str(n1["_dir"] / "efficiency.json")]) == 0


def test_n4_fsdp2_quarter_state(n4):
    (r,) = n4["rows"]
    _sane(r)
    _, shapes = _param_shapes()
    padded = _padded_bytes(shapes.values(), 4)
    assert r["world_size"] == 4 and len(r["per_rank"]) == 4
    for rank in r["per_rank"]:
        s = rank["state_bytes"]
        assert s["params"] == s["grads"] == padded // 4
        assert s["total"] <= 4 * padded // 4 + 4 * len(shapes)
