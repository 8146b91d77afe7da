"""Progress of long commands: plain lines off a terminal (a tenth at a time, then the end), a rich bar on
one, and both wired into `data prepare` and checkpoint export/import."""

from __future__ import annotations

import io

from meshforge.progress import track


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_a_tenth_at_a_time():
    out = io.StringIO()
    assert list(track(range(95), "work", stream=out)) == list(range(95))
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[0].startswith("work: 10/95 (10%") and lines[-1].startswith("work: 95/95 (100%")
    out = io.StringIO()
    assert list(track(iter("ab"), "two", total=2, stream=out)) == ["a", "b"]
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["two: 1/2", "two: 2/2"]


def test_rich_bar_on_a_terminal_and_off_when_disabled():
    tty = _Tty()
    assert list(track(range(7), "export", stream=tty)) == list(range(7))
    text = tty.getvalue()
    assert "export" in text and "7/7" in text and "━" in text and "\x1b[" in text  # a drawn, styled bar
    quiet = io.StringIO()
    assert list(track(range(3), "x", stream=quiet, enabled=False)) == [0, 1, 2] and quiet.getvalue() == ""


def test_data_prepare_and_checkpoint_export_import_show_progress(tmp_path, capsys):
    from meshforge.checkpoint.hf import export_checkpoint, import_hf, save_weights_only
    from meshforge.cli import main
    from meshforge.config import load_config
    from meshforge.models import build_model, resolve_model_args

    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text("hello " * (i + 1))
    assert main(["data", "prepare", *(str(tmp_path / f"t{i}.txt") for i in range(3)), "-o",
                 str(tmp_path / "tok.npy")]) == 0
    assert "data prepare: files read: 3/3 (100%" in capsys.readouterr().err

    model = build_model(resolve_model_args(load_config(None, ["model.n_layers=1"]).model))
    ckpt = save_weights_only(model, tmp_path / "ckpt")
    export_checkpoint(ckpt, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "back")
    err = capsys.readouterr().err
    n = len(list(model.named_parameters(remove_duplicate=False)))
    assert "export: safetensors files: 1/1 (100%" in err and f"import: tensors: {n}/{n} (100%" in err, err
    assert (tmp_path / "back" / "step_0" / "manifest.json").is_file()
