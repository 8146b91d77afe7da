"""`meshforge bench` pieces that need no launch: composing configurations, bad input (exit 2), the
collective-byte counter, exact state bytes, and the table/markdown/json/png outputs."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

from meshforge.bench import report, runner
from meshforge.bench.measure import CommCounter, state_bytes
from meshforge.cli import main
from meshforge.errors import BenchError

TINY = """model: {preset: tiny}
data: {source: synthetic}
training: {seq_len: 32, global_batch_size: 8, micro_batch_size: 2, device: cpu}
checkpoint: {resume: none}
"""


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    return str(p)


def test_compose_orders_overrides_and_names_configs():
    cs = runner.compose(["training.seq_len=16"], ["distributed.strategy=ddp,fsdp2"], [1, 2], False)
    assert [(c.name, c.nproc) for c in cs] == [("strategy=ddp N=1", 1), ("strategy=fsdp2 N=1", 1),
                                              ("strategy=ddp N=2", 2), ("strategy=fsdp2 N=2", 2)]
    assert cs[1].overrides == ["training.seq_len=16", "distributed.strategy=fsdp2"]
    m = runner.compose([], ["distributed.data_parallel_sharding_strategy=optim,no_shard"], [2], True)
    # the flag's perf overrides come first, the swept value after them wins
    assert m[1].overrides[:5] == runner.MEGATRON_FSDP_PERF_OVERRIDES
    assert m[1].overrides[-1] == "distributed.data_parallel_sharding_strategy=no_shard"
    assert [c.name for c in m] == ["data_parallel_sharding_strategy=optim", "data_parallel_sharding_strategy=no_shard"]
    two = runner.compose([], ["a.b=1,2", "c.d=x,y,z"], [1], False)
    assert len(two) == 6 and two[-1].swept == {"a.b": "2", "c.d": "z"}
    for bad in ("distributed.strategy", "=ddp", "distributed.strategy=ddp,,fsdp2", "k=a,a"):
        with pytest.raises(BenchError):
            runner.parse_sweep(bad)
    with pytest.raises(BenchError):
        runner.parse_nprocs("2,zero")


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("argv,needle", [
    (["--sweep", "distributed.strategy"], "--sweep"),
    (["--sweep", "training.precision=fp32,fp64"], "[precision=fp64]"),
    (["trainig.seq_len=8"], "trainig"),
    (["--steps", "0"], "--steps=0"),
    (["distributed.tp_size=4", "--nproc-per-node", "2"], "tp_size"),
])
def test_bad_input_is_one_line_and_exit_2(cfg_file, capsys, argv, needle):
    assert main(["bench", cfg_file, *argv]) == 2
    errs = _errors(capsys)
    assert errs and all(e.startswith("error: ") for e in errs) and needle in errs[0], errs


def test_missing_config_exit_2(tmp_path, capsys):
    assert main(["bench", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in _errors(capsys)[0]


def test_megatron_flag_applies_perf_overrides(cfg_file):
    cs = runner.compose([], [], [2], True)
    (cfg,) = runner.validate(cfg_file, cs)
    d = cfg.distributed
    assert (d.strategy, d.data_parallel_sharding_strategy, d.average_in_collective, d.keep_fp8_transpose_cache) \
        == ("megatron_fsdp", "optim_grads_params", False, False)
    assert cfg.checkpoint.resume is None


def test_unregistered_strategy_says_so_and_exits_2(cfg_file, capsys, monkeypatch):
    from meshforge.config import strategies

    monkeypatch.setattr(strategies, "_SPECS", {k: v for k, v in strategies._SPECS.items() if k != "megatron_fsdp"})
    assert main(["bench", cfg_file, "--use-megatron-fsdp", "true", "--nproc-per-node", "2"]) == 2
    errs = _errors(capsys)
    assert errs and "unknown strategy 'megatron_fsdp'; choose one of ddp, fsdp2" in errs[0], errs


@pytest.fixture
def gloo_world_1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_comm_counter_sees_every_entry_point(gloo_world_1):
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel

    x = torch.zeros(10)  # 40 bytes
    with CommCounter() as c:
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        dist.all_gather_into_tensor(torch.zeros(10), x)
        dist.reduce_scatter_tensor(torch.zeros(10), x)
        dist.all_gather_single(torch.zeros(10), x)  # what FSDP2 calls in torch 2.13
        dist.reduce_scatter_single(torch.zeros(10), x)
        dist.all_to_all_single(torch.zeros(10), x)
        funcol.all_reduce(torch.ones(5), "sum", gloo_world_1).wait()
    assert c.bytes == {"c10d::allreduce_": 40, "c10d::broadcast_": 40, "c10d::_allgather_base_": 80,
                       "c10d::_reduce_scatter_base_": 80, "c10d::alltoall_base_": 40,
                       "_c10d_functional::all_reduce": 20}, dict(c.bytes)
    # DDP's reducer calls the process group from C++: still counted (one bucket: weight + bias)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    with CommCounter() as c:
        model(torch.randn(3, 8)).sum().backward()
    assert c.bytes == {"c10d::allreduce_": (8 * 4 + 4) * 4}, dict(c.bytes)


def test_state_bytes_are_exact_for_a_plain_model():
    from meshforge.config.schema import ModelConfig
    from meshforge.models import build_model, init_weights

    model = build_model(ModelConfig(preset="tiny", tie_embeddings=True))
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    opt.step()
    params = list(model.parameters())  # the tied weight once
    p_bytes = sum(p.numel() * 4 for p in params)
    got = state_bytes([model], opt)
    assert got == {"source": "storages", "params": p_bytes, "grads": p_bytes,
                   "optimizer": 2 * p_bytes + 4 * len(params), "total": 4 * p_bytes + 4 * len(params)}


def _fake_result(device="cpu"):
    row = {"name": "strategy=ddp", "nproc": 1, "world_size": 1, "strategy": "ddp", "step_s_median": 0.01,
           "spread_pct": 4.0, "data_wait_s_median": 0.0025, "data_wait_s_mean": 0.004, "tokens_per_s_per_device": 25600.0, "tflops_per_device": 0.017, "mfu": None,
           "state_bytes_max": 2004052, "cuda_max_allocated_max": None, "comm_bytes_per_step": 0,
           "device_name": device, "seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2,
           "precision": "fp32", "n_params": 125248}
    failed = {"name": "strategy=fsdp2", "nproc": 2, "error": "RuntimeError: boom"}
    base = {"settings": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32",
                         "n_params": 125248},
            "bare": {"step_s_median": 0.008, "spread_pct": 3.0, "tokens_per_s_per_device": 32000.0,
                     "tflops_per_device": 0.02, "mfu": None},
            "ratio": 1.02, "ratio_p25": 0.99, "ratio_p75": 1.05, "ratio_of_medians": 1.03, "pairs": 12,
            "ratio_without_data": 1.01}
    return {"rows": [row, failed], "baseline": base, "meta": {"steps": 3, "warmup": 1, "device": device}}


def test_report_files(tmp_path, monkeypatch):
    paths = report.write_outputs(_fake_result(), tmp_path)
    md = (tmp_path / "bench.md").read_text().splitlines()
    assert md[0].startswith("| config | N | strategy | step ms")
    assert md[2].startswith("| strategy=ddp | 1 | ddp | 10.00 | 4% | 2.50 / 4.00 | 25,600 |") and md[2].endswith("| 1.250 |")
    assert "failed: RuntimeError: boom" in md[3] and md[4].startswith("| bare PyTorch loop | 1 |")
    assert any("meshforge / bare PyTorch step time at world size 1: 1.020" in line for line in md)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["tokens_per_s_per_device"] == 25600.0
    try:
        import matplotlib  # noqa: F401

        assert paths["png"] == tmp_path / "bench.png" and (tmp_path / "bench.png").stat().st_size > 1000
    except ImportError:
        assert "skipped" in paths["png"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the optional extra missing: a note, not an error
    os.remove(tmp_path / "bench.png") if (tmp_path / "bench.png").exists() else None
    paths = report.write_outputs(_fake_result(), tmp_path)
    assert paths["png"].startswith("bench.png skipped: matplotlib is not installed")
    assert not (tmp_path / "bench.png").exists()
