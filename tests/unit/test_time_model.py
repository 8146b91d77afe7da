"""The planner's time model: efficiencies said in every plan, the matmul size curve, FP8, calibration from a run
directory or a bench output (its arithmetic; the CPU proof against measured runs is
tests/parallel/test_time_calibration.py), bad input, and what `--fit` searches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.cli import main
from meshforge.config import load_config
from meshforge.planning.hardware import DEVICES, default_efficiency
from meshforge.planning.plan import plan
from meshforge.planning.step import gemm_seconds

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
LLAMA3_405B = ["model.dim=16384", "model.n_layers=126", "model.n_heads=128", "model.n_kv_heads=8",
               "model.ffn_dim=53248", "training.global_batch_size=2048", "training.compile=false"]


def test_every_plan_says_which_efficiencies_and_where_from(capsys):
    cfg = str(EX / "llama3_8b.yaml")
    assert main(["plan", cfg, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "efficiencies: matmul 0.80 of peak" in out and "h100 datasheet defaults" in out
    assert main(["plan", cfg, "--world-size", "8", "--mfu", "0.5"]) == 0
    assert "--mfu 0.5 (one number for all compute, as given)" in capsys.readouterr().out
    assert main(["plan", cfg, "--world-size", "8", "--compare", "training.micro_batch_size=1,2"]) == 0
    assert "efficiencies: " in capsys.readouterr().out
    assert main(["plan", cfg, "--world-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["efficiency"]["source"].startswith("h100 datasheet defaults") and out["compute_parts_s"]["matmul"] > 0


def test_small_and_split_matmuls_run_below_the_large_ones_rate():
    """The roofline with a fixed time per kernel: FLOP/s rise with the size; a TP-split matmul runs slower per
    FLOP, so TP 8 costs more than 1/8 of the compute."""
    dev, eff = DEVICES["h100"], default_efficiency(DEVICES["h100"])
    rate = {n: 2 * n**3 / gemm_seconds(n, n, n, 2, dev, eff) for n in (256, 1024, 8192)}
    assert rate[256] < rate[1024] < rate[8192] <= dev.peak_tflops * 1e12 * eff.gemm
    assert rate[8192] > 0.95 * dev.peak_tflops * 1e12 * eff.gemm and rate[256] < 0.2 * rate[8192]
    one = plan(load_config(str(EX / "llama3_8b.yaml"), ["training.seq_len=1024"], world_size=8), 8, dev)
    tp8 = plan(load_config(str(EX / "llama3_8b.yaml"), ["training.seq_len=1024", "distributed.tp_size=8"],
                           world_size=8), 8, dev)
    assert tp8.time.parts["matmul"] > one.time.parts["matmul"]  # the same FLOPs per rank, in 8x narrower matmuls


def test_fp8_prices_the_converted_matmuls_faster_and_says_so():
    base = ["training.global_batch_size=16", "training.micro_batch_size=2"]
    plans = {fp8: plan(load_config(str(EX / "llama3_8b.yaml"), base + [f"training.fp8.enabled={fp8}"], world_size=8),
                       8, DEVICES["h100"]) for fp8 in ("false", "true")}
    assert plans["true"].time.parts["matmul"] < 0.7 * plans["false"].time.parts["matmul"]
    assert plans["true"].step_s < plans["false"].step_s
    assert any("training.fp8" in n and "1.8x" in n for n in plans["true"].notes)
    assert not any("training.fp8" in n for n in plans["false"].notes)
    # compile changes no price: said, not silent
    assert any("training.compile: step time priced with eager kernels" in n for n in plans["true"].notes)


@pytest.mark.slow  # importing torchao takes seconds
def test_fp8_auto_filter_is_torchaos():
    pytest.importorskip("torchao")
    from torch import nn
    from torchao.float8 import _auto_filter_for_recipe

    from meshforge.planning.precision import FP8_AUTO

    for recipe, mine in FP8_AUTO.items():
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for n in (512, 1024, 2048, 4096, 8192, 14336):
            for k in (512, 1024, 2048, 4096, 8192):
                assert mine(n, k) == theirs(nn.Linear(k, n, device="meta"), "layers.0.w"), (recipe, n, k)


def _gpu_bench(tmp_path: Path, factor: float) -> tuple[Path, float]:
    """A bench output of one H100 row whose step took `factor` x the default plan's (the fit's arithmetic)."""
    cfg_path = EX / "llama3_8b.yaml"
    overrides = ["training.global_batch_size=16", "training.micro_batch_size=2"]
    planned = plan(load_config(str(cfg_path), overrides, world_size=8), 8, DEVICES["h100"]).step_s
    row = {"name": "N=8", "world_size": 8, "overrides": overrides, "device_name": "NVIDIA H100 80GB HBM3",
           "step_s_median": factor * planned}
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text(json.dumps({"rows": [row], "meta": {"config": str(cfg_path)}}))
    return out, factor * planned


def test_calibration_on_a_gpu_bench_fits_a_compute_scale_and_later_plans_use_it(tmp_path, capsys):
    bench, measured = _gpu_bench(tmp_path, 1.3)
    assert main(["plan", "--calibrate", str(bench)]) == 0
    out = capsys.readouterr().out
    assert "+0.0%" in out and f"wrote {bench}/efficiency.json" in out
    saved = json.loads((bench / "efficiency.json").read_text())
    assert saved["device"]["name"] == "h100" and 1.29 < saved["efficiency"]["compute_scale"] < 1.6
    assert saved["fit"]["rows"][0]["fitted_s"] == pytest.approx(measured, rel=1e-6)
    cfg = str(EX / "llama3_8b.yaml")
    argv = ["plan", cfg, "training.global_batch_size=16", "training.micro_batch_size=2", "--world-size", "8"]
    assert main([*argv, "--efficiency", str(bench / "efficiency.json"), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["step_s"] == pytest.approx(measured, rel=1e-6) and "[file " in p["efficiency"]["source"]
    # the same model on 64 devices: the calibrated scale carries over
    assert main(["plan", cfg, "--world-size", "64", "--efficiency", str(bench / "efficiency.json")]) == 0
    assert "calibrated on" in capsys.readouterr().out


def test_calibration_from_a_run_directory(tmp_path, capsys):
    """metrics.jsonl's tokens/s after the first interval, run_meta.json's config (as the jsonl logger writes it)."""
    cfg = load_config(str(EX / "llama3_8b.yaml"), ["training.global_batch_size=16", "training.micro_batch_size=2"],
                      world_size=8)
    from meshforge.config.schema import BRIDGE_SECTIONS

    run = tmp_path / "run"
    run.mkdir()
    (run / "run_meta.json").write_text(json.dumps({"config": cfg.model_dump(mode="json", exclude=BRIDGE_SECTIONS),
                                                   "meta": {"world_size": 8, "device": "cuda:0"}}))
    tokens = 16 * cfg.training.seq_len
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "tokens_per_s": tokens / sec})
                                                 for s, sec in ((10, 9.0), (20, 2.0), (30, 2.2), (40, 2.1))))
    assert main(["plan", "--calibrate", str(run)]) == 0
    out = capsys.readouterr().out
    assert "2.1000" in out and "wall" in out  # the median of the intervals after the first


@pytest.mark.parametrize("argv, message", [
    (["plan", "--calibrate", "{tmp}/nothing"], "no bench.json"),
    (["plan", "--efficiency", "{tmp}/none.json", "{ex}/llama3_8b.yaml", "--world-size", "8"], "no such file"),
    (["plan", "--efficiency", "{tmp}/bad.json", "{ex}/llama3_8b.yaml", "--world-size", "8"], "not an efficiency file"),
    (["plan", "{ex}/llama3_8b.yaml", "--world-size", "8", "--mfu", "0.4", "--efficiency", "{tmp}/bad.json"],
     "use one"),
    (["plan"], "needs CONFIG"),
    (["plan", "{ex}/llama3_8b.yaml"], "needs --world-size"),
    (["plan", "{ex}/llama3_8b.yaml", "--world-size", "8", "--gpu", "cpu"], "measured, not assumed"),
    (["plan", "{ex}/llama3_8b.yaml", "--world-size", "8", "--gpu", "h100:-1:80"], "positive numbers"),
])
def test_calibration_bad_input_is_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    (tmp_path / "bad.json").write_text('{"device": {}}')
    assert main([a.format(tmp=tmp_path, ex=EX) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


def test_efficiency_file_of_another_device_is_refused(tmp_path, capsys):
    bench, _ = _gpu_bench(tmp_path, 1.0)
    assert main(["plan", "--calibrate", str(bench)]) == 0
    capsys.readouterr()
    assert main(["plan", str(EX / "llama3_8b.yaml"), "--world-size", "8", "--gpu", "a100", "--efficiency",
                 str(bench / "efficiency.json")]) == 2
    assert "measured on h100" in capsys.readouterr().err


@pytest.mark.slow  # a --fit search over 405B layouts: seconds of its own
def test_fit_proposes_llama3_405b_virtual_stages_and_uneven_ends():
    """126 blocks on 16 pipeline ranks x 8 virtual stages need the ends (128 stages, the first the embedding only,
    the last the head only): the layout Llama 3 405B ran, found by the search; every row says why it ranks. On an
    H200: on an 80 GiB H100 meshforge's program does not fit it (fsdp2 under PP keeps every stage's unsharded
    fp32 gradients through the schedule, measured by the scale trace: docs/scale.md), and the search says so by
    proposing 4 stages per rank there."""
    from meshforge.planning.fit import search

    cfg = load_config(str(EX / "llama3_70b_tp_pp.yaml"), LLAMA3_405B, world_size=16384)
    fits, rejected, _ = search(cfg, 16384, DEVICES["h200"])
    labels = [f.choice.label(16384) for f in fits]
    assert any("pp16x8v+ends" in lab for lab in labels), labels
    assert any(f.choice.v > 2 for f in fits)
    steps = [f.plan.step_s for f in fits]
    assert steps == sorted(steps) and all(f.plan.fits for f in fits)
    assert fits[0].reason.startswith("fastest: ") and all(" vs #1: " in f.reason or f.reason.startswith("ties")
                                                          for f in fits[1:])
    assert rejected


def test_fit_proposes_moe_stages_and_keeps_the_configs_ep_size():
    """An MoE with expert parallelism: pipeline stages with experts are proposed (issue 28), and a layout whose
    dp x cp the config's ep_size does not divide is rejected with that reason (it divided by zero in the plan)."""
    from meshforge.planning.fit import search

    cfg = load_config(str(EX / "qwen3_moe_ep8.yaml"), ["model.n_layers=8"], world_size=32)
    fits, rejected, _ = search(cfg, 32, DEVICES["h100"])
    assert any(f.choice.pp > 1 for f in fits), [f.choice.label(32) for f in fits]
    reasons = {why for _, why in rejected}
    assert "distributed.ep_size=8 does not divide dp 2 x cp 2" in reasons, reasons
    assert not any("division" in why for why in reasons), reasons
