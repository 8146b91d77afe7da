"""Evaluation during training (`training.eval_every` with `training.eval`): held-out perplexity and a local lm-eval
multiple-choice task (written here, nothing downloaded) scored on the live model at the right steps, each record
equal to `meshforge eval` on the checkpoint saved at that step (the same numbers), and training untouched: the
losses equal the same run without it bitwise and an exact resume still holds; on one process and on two (fsdp2,
in the shared 2-process launch). Bad input is one line each, exit 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshforge.cli import main as cli_main
from meshforge.testing.eval_task import TASK_YAML  # the local multiple-choice task (acc, acc_norm)
from meshforge.testing.group import Job
from meshforge.testing.parity import config, single_info

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # lm-eval and several tiny runs: tens of seconds

SHARED = Path(os.environ.get("MESHFORGE_TEST_SHARED", "/tmp"))
FILES = SHARED / "eval-training-files"
OUT2 = SHARED / "eval-training-fsdp2"
BASE = ["data.source=text", "data.max_files=2", "model.init_std=0.2"]
STEPS = 3
DOCS = [("def f(x):\n    return", [" x", " 7 +", " import"]), ("import o", ["s", "r", "("]),
        ("for i in range(", ["10):", "):", "]:"]), ("class A", ["(object):", " = 1", " if"]),
        ("if __name__ ==", [" '__main__':", " 3", " def"]), ("while True", [":", " = ", "(("])]


def write_files(folder: Path = FILES) -> Path:
    """The task (its YAML and jsonl) and a held-out text file, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    docs = [{"prompt": p, "choices": c, "label": i % 3} for i, (p, c) in enumerate(DOCS)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_mc.yaml").write_text(TASK_YAML.format(data=folder / "mc.jsonl"))
    (folder / "held_out.py").write_text("import os\n\n\ndef main(argv):\n    for a in argv:\n        print(a)\n" * 8)
    return folder


def eval_overrides(folder: Path, every: int) -> list[str]:
    return [f"training.eval_every={every}",
            f"training.eval={{paths: [{folder / 'held_out.py'}], tasks: [tiny_mc], include: [{folder}], limit: 5}}"]


def eval_job(spec, info) -> dict:
    """fsdp2 over two ranks: the same run without and with evaluation every 2 steps (checkpoints at every step);
    tp2 with sequence parallelism evaluating at its last step."""
    from meshforge.training.trainer import train

    plain = train(config(BASE, STEPS, info.world_size), info)
    res = train(config(BASE + eval_overrides(FILES, 2) + [f"run.output_dir={OUT2}", "checkpoint.interval=1"],
                       STEPS, info.world_size), info)
    tp = train(config(BASE + eval_overrides(FILES, STEPS) + [
        f"run.output_dir={OUT2}-tp2", "checkpoint.interval=3", "distributed.tp_size=2",
        "distributed.sequence_parallel=true"], STEPS, info.world_size), info)
    return {"plain": plain.losses, "losses": res.losses, "evaluations": res.evaluations, "tp2": tp.evaluations}


GROUP_JOBS = [Job("eval during training n2", f"{Path(__file__).resolve()}:eval_job", None, 2, prepare=write_files)]


def _train(extra, steps=STEPS):
    from meshforge.training.trainer import train

    return train(config(BASE + list(extra), steps, world_size=1), single_info())


def _meshforge_eval(checkpoint: Path, folder: Path, tmp_path: Path) -> dict:
    """`meshforge eval` on one saved checkpoint, as a record of training's (eval/loss, eval/ppl, eval/<task>/...)."""
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.json"
    argv = ["eval", str(checkpoint), *BASE[:2], f"data.paths=[{folder / 'held_out.py'}]", "training.seq_len=32",
            "training.micro_batch_size=2", "--tasks", "tiny_mc", "--include", str(folder), "--limit", "5",
            "--output", str(out)]
    assert cli_main(argv) == 0
    got = json.loads(out.read_text())
    ppl = got["perplexity"]["data"]
    return {"eval/loss": ppl["loss"], "eval/ppl": ppl["ppl"],
            **{f"eval/{t}/{k}": v for t, m in got["tasks"].items() for k, v in m.items()}}


def _same_scores(logged: dict, cli: dict, exact: bool = True) -> None:
    """The same numbers: bitwise where the forward's arithmetic is the same (one process, fsdp2's gathered
    weights); under TP (the matmuls split across ranks) the loss within fp32 rounding, the accuracies exactly."""
    logged = {k: v for k, v in logged.items() if k != "step"}
    if exact:
        assert logged == cli
    else:
        assert logged == {k: pytest.approx(v, rel=1e-6) if k in ("eval/loss", "eval/ppl") else v
                          for k, v in cli.items()}


def test_eval_every_step_changes_nothing_and_equals_meshforge_eval(tmp_path):
    folder = write_files(tmp_path / "files")
    ref = _train([], steps=4)
    a = tmp_path / "a"
    first = _train(eval_overrides(folder, 1) + [f"run.output_dir={a}", "checkpoint.interval=1",
                                                 "logging.loggers=[jsonl]"], steps=4)
    assert first.losses == ref.losses  # bitwise: the evaluation touched neither the RNG nor the data order
    assert [r["step"] for r in first.evaluations] == [1, 2, 3, 4]
    assert {"eval/loss", "eval/ppl", "eval/tiny_mc/acc", "eval/tiny_mc/acc_norm"} <= set(first.evaluations[0])
    logged = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in logged if "eval/loss" in r] == first.evaluations
    for record in (first.evaluations[1], first.evaluations[3]):
        _same_scores(record, _meshforge_eval(a / "checkpoints" / f"step_{record['step']}", folder, tmp_path))
    resumed = _train(eval_overrides(folder, 1) + [f"run.output_dir={tmp_path / 'b'}",
                                                  f"checkpoint.resume={a / 'checkpoints/step_2'}"], steps=4)
    assert resumed.start_step == 2 and resumed.losses == ref.losses[2:]
    assert resumed.evaluations == first.evaluations[2:]


def test_eval_during_fsdp2_training_equals_meshforge_eval(group, tmp_path):
    got = group("eval during training n2")
    assert got["losses"] == got["plain"]  # bitwise, with evaluation at steps 2 and 3
    assert [r["step"] for r in got["evaluations"]] == [2, STEPS]
    for record in got["evaluations"]:  # the 2-rank checkpoint, resharded into one process by `meshforge eval`
        _same_scores(record, _meshforge_eval(OUT2 / "checkpoints" / f"step_{record['step']}", FILES, tmp_path))
    # tensor-parallel (with sequence parallelism): logits gathered, sequences padded to a multiple of tp_size
    (record,) = got["tp2"]
    _same_scores(record, _meshforge_eval(Path(f"{OUT2}-tp2") / "checkpoints" / f"step_{STEPS}", FILES, tmp_path),
                 exact=False)


def test_eval_every_bad_input_is_one_line(tmp_path, capsys):
    from meshforge.config import load_config
    from meshforge.errors import MeshforgeError
    from meshforge.training.trainer import Trainer

    folder = write_files(tmp_path / "files")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "mc.jsonl").write_text('{"question": "a", "answers": ["b"]}\n')
    (tmp_path / "bad" / "tiny_mc.yaml").write_text(TASK_YAML.format(data=tmp_path / "bad" / "mc.jsonl"))

    def problems(*overrides, world_size=1):
        with pytest.raises(MeshforgeError) as err:
            cfg = load_config(None, ["training.device=cpu", *BASE, *overrides], world_size=world_size)
            Trainer.build(cfg, single_info())
        assert len(err.value.problems) == 1, err.value.problems
        return err.value.problems[0]

    tasks = f"training.eval={{tasks: [tiny_mc], include: [{folder}]}}"
    assert "greater than 0" in problems("training.eval_every=0", tasks)
    assert "training.eval_every needs training.eval" in problems("training.eval_every=2")
    assert "training.eval_every needs training.eval" in problems(tasks)
    assert "no tasks given" in problems("training.eval_every=2", "training.eval={limit: 3}")
    assert "needs training.eval.include" in problems("training.eval_every=2", "training.eval={tasks: [tiny_mc]}")
    assert "'nope' is not in training.eval.include" in problems(
        "training.eval_every=2", f"training.eval={{tasks: [nope], include: [{folder}]}}")
    assert problems("training.eval_every=2", f"training.eval={{tasks: [tiny_mc], include: [{tmp_path / 'bad'}]}}"
                    ).startswith("training.eval: task 'tiny_mc' cannot be built from its files (a task YAML or data "
                                 "file of the wrong shape?)")
    assert "training.eval_every with distributed.pp_size=2 is not supported yet" in problems(
        "training.eval_every=2", tasks, "distributed.pp_size=2", "model.n_layers=2", world_size=2)
    assert "data.source=synthetic does not read" in problems(
        "data.source=synthetic", "data.max_files=null", "training.eval_every=2",
        f"training.eval={{paths: [{folder / 'held_out.py'}]}}")
    assert problems("training.eval_every=2", f"training.eval={{paths: [{tmp_path / 'missing.txt'}]}}").startswith(
        "training.eval.paths: ")
    # from the command line: one line, exit 2, no traceback
    capsys.readouterr()
    assert cli_main(["train", "model.preset=tiny", "training.device=cpu", *BASE, "training.eval_every=0", tasks]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, err
