"""`meshforge plot`: runs' curves overlaid in one PNG, read back (size, the runs' colours) with the curve count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshforge.cli import main


def _run(path, name, steps, val=False, scale=1.0):
    path.mkdir(parents=True)
    recs = [{"step": s, "loss": scale * 5 / s, "grad_norm": 1 + 1 / s, "lr": 1e-3 * min(1, s / 3),
             "tokens_per_s": 1000.0 + s, "tflops": 0.1, "mfu": None, "max_mem_gib": 0.5 + 0.01 * s}
            for s in range(1, steps + 1)]
    if val:
        recs += [{"step": s, "val_loss": scale * 5.5 / s} for s in (5, 10)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "run_meta.json").write_text(json.dumps({"config": {"run": {"name": name}}, "meta": {}}))
    return str(path)


def test_plot_overlays_runs(tmp_path, capsys):
    a = _run(tmp_path / "a", "baseline", 10, val=True)
    b = _run(tmp_path / "b", "wsd", 12, scale=0.8)
    out = tmp_path / "curves.png"
    assert main(["plot", a, b, "-o", str(out)]) == 0
    line = capsys.readouterr().out
    # loss: 2 runs + 1 val_loss curve; lr, grad_norm, tokens/s, memory: 2 each
    assert "2 run(s), 11 curves" in line and "loss 3" in line and "max_mem_gib 2" in line, line
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    assert (width, height) == (1200, 640)
    import matplotlib.image

    rgb = (matplotlib.image.imread(str(out))[..., :3] * 255).round().astype(int)
    for colour in ("#1f77b4", "#ff7f0e"):  # C0 and C1: each run drew pixels
        want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(rgb - want).sum(-1) < 30).sum() > 200, colour  # ~500 each at this size


def test_plot_counts_curves_per_panel(tmp_path):
    from meshforge.plot import plot_runs

    runs = [_run(tmp_path / f"r{i}", f"run{i}", 6) for i in range(3)]
    counts = plot_runs(runs, str(tmp_path / "p.png"))
    assert counts == {"loss": 3, "lr": 3, "grad_norm": 3, "tokens_per_s": 3, "max_mem_gib": 3}


@pytest.mark.parametrize("content, msg", [(None, "no metrics.jsonl"), ("{oops\n", "is not a JSON line"),
                                          ("", "holds no logged steps")])
def test_plot_bad_run_is_one_line(tmp_path, capsys, content, msg):
    d = tmp_path / "bad"
    d.mkdir()
    if content is not None:
        (d / "metrics.jsonl").write_text(content)
    assert main(["plot", str(d), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "x.png").exists()
