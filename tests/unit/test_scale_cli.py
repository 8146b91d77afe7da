"""`meshforge plan` without processes: bad input is one line and exit 2, the trace refuses what its estimate says it
cannot afford (before starting anything), and the headroom decides "fits". `meshforge plan` imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshforge.cli import main
from meshforge.planning.headroom import NONE, Headroom, headroom_from_arg

ROOT = Path(__file__).resolve().parents[2]
EX = str(ROOT / "examples" / "llama3_70b_tp_pp.yaml")
LLAMA3_405B = ["model.dim=16384", "model.n_layers=128", "model.n_heads=128", "model.n_kv_heads=8",
               "model.ffn_dim=53248", "distributed.pp_size=16", "distributed.pipeline.virtual_stages_per_rank=8",
               "distributed.activation_checkpointing=false", "training.global_batch_size=2048",
               "training.compile=false"]


def _one_line_exit_2(capsys, argv: list[str], words: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("argv, words", [
    (["--world-size", "0"], "give the number of devices"),
    (["--world-size", "-64"], "give the number of devices"),
    (["--world-size", "1099511627776"], "beyond any job"),
    (["--world-size", "63"], "does not divide the world size 63"),
    (["--world-size", "64", "--gpu", "h1000"], "not a known device"),
    (["--world-size", "64", "--headroom", "fragmentation=2"], "--headroom"),
    (["--world-size", "64", "--trace", "--ranks", "0,64"], "give ranks 0 to 63"),
    (["--world-size", "64", "--trace", "--ranks", "first,x"], "give ranks 0 to 63"),
    (["--world-size", "64", "--trace", "--fit"], "drop --fit"),
    (["--world-size", "64", "--trace", "--trace-limit-s", "0"], "must be positive"),
    (["--world-size", "64", "--trace", "--gpu", "h1000"], "not a known device"),
    (["--world-size", "1099511627776", "--trace"], "beyond any job"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, words):
    _one_line_exit_2(capsys, ["plan", EX, *argv], words)


def test_trace_refuses_over_its_limits_with_the_estimate(capsys):
    """A trace the estimate says is over the limits is refused before any process starts, with the estimate."""
    assert main(["plan", EX, "--world-size", "64", "--trace", "--trace-limit-s", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("estimated at" in line and "--trace-limit-s 5" in line for line in err), err
    assert main(["plan", EX, *LLAMA3_405B, "--world-size", "8192", "--trace", "--ranks", "0",
                 "--trace-limit-gb", "0.1"]) == 2
    assert "--trace-limit-gb 0.1" in capsys.readouterr().err


def test_trace_refuses_what_it_cannot_trace_yet(capsys, tmp_path):
    """A transformers MoE routes by values fake tensors do not have: one line before any process starts."""
    pytest.importorskip("transformers")
    from tests.checkpoint.hf_zoo import write_tiny

    folder = write_tiny("qwen3_moe", tmp_path / "moe")
    cfg = tmp_path / "hf.yaml"
    cfg.write_text(f"model: {{hf_model: {folder}}}\ntraining: {{device: cpu, seq_len: 32}}\n")
    assert main(["plan", str(cfg), "--world-size", "2", "--trace"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("W")]  # (torch's warnings)
    assert len(err) == 1 and "model.hf_model with routed experts cannot be traced yet" in err[0], err


def test_headroom_decides_fits(capsys):
    """The 8B example at 8 ranks, 2 sequences a rank: the tensors (73.6 GB measured by the trace at this shape,
    docs/scale.md) fit a 76 GiB device, with the allocator's, CUDA's and NCCL's margins they do not."""
    argv = ["plan", str(ROOT / "examples" / "llama3_8b.yaml"), "training.global_batch_size=16",
            "training.micro_batch_size=2", "--world-size", "8", "--gpu", "gpu76:989:76", "--json"]
    assert main([*argv, "--headroom", "none"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    margins = json.loads(capsys.readouterr().out)
    assert bare["peak_bytes"] == margins["peak_bytes"] and bare["fits"] and not margins["fits"]
    assert margins["required_bytes"] == margins["peak_bytes"] + sum(margins["headroom"].values())
    assert margins["headroom"]["fragmentation"] == int(0.1 * margins["peak_bytes"])
    assert sum(bare["headroom"].values()) == 0


def test_headroom_arguments():
    assert headroom_from_arg(None) == Headroom() and headroom_from_arg("none") == NONE
    h = headroom_from_arg("fragmentation=0.05,nccl_mib=0")
    assert h.fragmentation == 0.05 and h.nccl_mib == 0 and h.context_gib == Headroom().context_gib
    for bad in ("frag=1", "fragmentation=1", "nccl_mib=-1", "context_gib=x"):
        with pytest.raises(ValueError, match="--headroom"):
            headroom_from_arg(bad)


def test_plan_without_trace_imports_no_torch():
    code = ("import sys; from meshforge.cli import main; "
            f"main(['plan', {EX!r}, '--world-size', '64', '--json']); print('torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip().splitlines()[-1] == "False", out.stderr
