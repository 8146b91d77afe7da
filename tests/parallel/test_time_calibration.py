"""The calibrated time model predicts other layouts: calibrate on one measured layout, predict three others.

One job of the shared N=2 launch measures four layouts of the `small` model on gloo with the bench's own
interleaved measurement (`bench.worker.measure_interleaved`: built side by side, their timed steps in turn, so a
shared machine's changing load falls on all of them alike), and profiles the device in the same launch (matmul
curve, attention, the model's own elementwise kernels, collectives; its block probe once per round scales the
profile to the steps' load). The test writes the calibration layout's row as a bench output, runs
`meshforge plan --calibrate` on it, and plans the other three with the written efficiency file:
  strategy         ddp instead of fsdp2
  sequence length  256 instead of 128 tokens (micro batch 2, the same tokens per step)
  pipeline         PP 2 (1F1B, 2 micro batches of 4) instead of fsdp2 over 2 ranks
Each prediction must be within 15% of its measured step time. On CPU the step time compared is the device's busy
time (the slowest rank's process CPU time per step: a CPU core is the device; the wall time of this shared machine
holds other jobs' turns on the cores, 2-5x the busy time under load), which is what the plan's `busy_s` is: the
step less its pipeline idle time. Measured while writing it (torch 2.13, 2 cores shared with other jobs, load
5-40): ddp -7..+6%, sequence length -3..+12% (once +22% at load 40), pipeline 0..+11%; not asserted: full
checkpointing -4..+9%, micro batch 2 +10..+16%, megatron_fsdp +14..+23%, PP with micro batches of 1 -20%, tensor
parallelism -44..-63% (DTensor's host time is not modelled; the plan says so in a note). docs/strategies.md has
the table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshforge.testing.group import Job

pytestmark = pytest.mark.dist

BASE = ["model.preset=small", "training.seq_len=128", "training.global_batch_size=8", "training.micro_batch_size=4",
        "distributed.strategy=fsdp2"]
CALIBRATE_ON = "fsdp2"
LAYOUTS = {
    "fsdp2": [],
    "ddp": ["distributed.strategy=ddp"],
    "seq_len_256": ["training.seq_len=256", "training.global_batch_size=4", "training.micro_batch_size=2"],
    "pp2": ["distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=4"],
}
TOLERANCE = 0.15


def measure_job(spec: dict, info) -> list[dict]:
    """Every layout measured interleaved, the device profiled; rank 0's rows with their names and overrides."""
    from meshforge.bench.worker import measure_interleaved
    from meshforge.testing.parity import base_overrides, config

    overrides = {name: base_overrides(100) + BASE + ov for name, ov in spec["layouts"].items()}
    cfgs = [config(ov, steps=100, world_size=info.world_size) for ov in overrides.values()]
    rows = measure_interleaved(cfgs, info, spec["steps"], spec["warmup"], profile=True)
    for row, (name, ov) in zip(rows, overrides.items()):
        row.update(name=name, nproc=info.world_size, overrides=ov)
    return rows


HERE = f"{Path(__file__).resolve()}"
GROUP_JOBS = [Job("time calibration n2", f"{HERE}:measure_job", {"layouts": LAYOUTS, "steps": 5, "warmup": 1}, 2)]


def test_calibrated_plan_predicts_other_layouts(group, tmp_path, capsys):
    from meshforge.bench.report import write_outputs
    from meshforge.cli import main
    from meshforge.config import load_config
    from meshforge.planning import calibrate
    from meshforge.planning.plan import plan

    rows = {r["name"]: r for r in group("time calibration n2")}
    assert all("error" not in r for r in rows.values()), [r.get("error") for r in rows.values()]
    profile = next(r["device_profile"] for r in rows.values() if "device_profile" in r)
    assert len(profile["probe_rounds_s"]) == 5 and profile["matmul"] and profile["collectives"]
    cal = dict(rows[CALIBRATE_ON], device_profile=profile)
    write_outputs({"rows": [cal], "baseline": None, "meta": {"config": None}}, str(tmp_path))
    assert main(["plan", "--calibrate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "efficiencies: " in out and "calibrated on" in out
    device, eff = calibrate.load(tmp_path / "efficiency.json")
    assert device.name == "cpu" and not eff.overlap and eff.compute_scale > 0
    errors, lines = {}, []
    for name, row in rows.items():
        cfg = load_config(None, row["overrides"], world_size=row["world_size"])
        t = plan(cfg, row["world_size"], device, efficiency=eff).time
        errors[name] = t.busy_s / row["step_busy_s_median"] - 1
        lines.append(f"{name}: measured {row['step_busy_s_median'] * 1e3:.1f} ms busy ({row['step_s_median'] * 1e3:.1f} ms "
              f"wall), predicted {t.busy_s * 1e3:.1f} ms ({', '.join(f'{k} {v * 1e3:.1f}' for k, v in t.parts.items())},"
              f" communication {t.exposed_s * 1e3:.1f}): {100 * errors[name]:+.1f}% (kernels of its counted step: "
                     f"{', '.join(f'{k} {v * 1e3:.1f}' for k, v in row['step_kernels_s'].items())})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert abs(errors[CALIBRATE_ON]) < 1e-6, lines  # the calibration reproduces its own layout
    others = {n: e for n, e in errors.items() if n != CALIBRATE_ON}
    assert len(others) >= 3 and all(abs(e) <= TOLERANCE for e in others.values()), lines
    # the file says where it came from, and a plan with it says so too
    assert json.loads((tmp_path / "efficiency.json").read_text())["fit"]["rows"][0]["name"] == CALIBRATE_ON
    cfg_path = tmp_path / "small.yaml"
    cfg_path.write_text("model: {preset: small}\ntraining: {device: cpu, seq_len: 128}\n")
    assert main(["plan", str(cfg_path), "--world-size", "4", "--efficiency", str(tmp_path / "efficiency.json")]) == 0
    assert f"[file {tmp_path / 'efficiency.json'}]" in capsys.readouterr().out
