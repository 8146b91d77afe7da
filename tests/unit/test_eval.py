"""`meshforge eval` (evaluation/): perplexity on held-out files from a run directory equals what the exported
Hugging Face model gives in transformers, and lm-eval on a local multiple-choice task (written here, nothing
downloaded) gives the same accuracy and the same per-choice log-likelihoods through meshforge's adapter as through
lm-eval's own HFLM on the exported model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from meshforge.cli import main
from meshforge.testing.eval_task import TASK_YAML
from meshforge.testing.parity import config, single_info

pytestmark = pytest.mark.slow  # a training run, transformers and lm-eval: tens of seconds

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "data" / "chat_tiny.jsonl"
PC = ROOT / "examples" / "data" / "prompt_completion_tiny.jsonl"
TOK = ROOT / "examples" / "data" / "chat_tokenizer"
DATA = [f"data.tokenizer={TOK}", "model.vocab_size=320"]



@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained 6 steps on the shipped prompt/completion set (BPE tokenizer), its run directory and
    its Hugging Face export, and a local multiple-choice task on the same kind of text."""
    from meshforge.training.trainer import train

    root = tmp_path_factory.mktemp("eval")
    run = root / "run"
    cfg = config(["data.source=dataset", f"data.paths=[{CHAT}]", "data.format=chat", *DATA,
                  "checkpoint.save_final=true", f"run.output_dir={run}", "optimizer.lr=3e-3"], 6)
    train(cfg, single_info())
    assert main(["checkpoint", "export", str(run), "--to", str(root / "hf")]) == 0
    docs = []
    for i, line in enumerate(PC.read_text().splitlines()[:12]):
        rec = json.loads(line)
        others = [json.loads(x)["completion"] for x in PC.read_text().splitlines()[12 + i:14 + i]]
        choices = [rec["completion"], *others]
        docs.append({"prompt": rec["prompt"], "choices": choices, "label": i % 3})
        docs[-1]["choices"][0], docs[-1]["choices"][i % 3] = docs[-1]["choices"][i % 3], docs[-1]["choices"][0]
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "tiny_mc.yaml").write_text(TASK_YAML.format(data=tasks / "mc.jsonl"))
    return run, root / "hf", tasks


def test_perplexity_of_a_run_equals_transformers_on_its_export(trained, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run, hf, _ = trained
    out = tmp_path / "ppl.json"
    argv = ["eval", str(run), "data.source=dataset", f"data.paths=[{PC}]", "data.format=prompt_completion",
            "data.loss_on=all", "training.seq_len=32", f"--output={out}"]
    assert main(argv) == 0
    got = json.loads(out.read_text())["perplexity"]["data"]
    assert "perplexity data: loss=" in capsys.readouterr().out
    # the same samples through transformers: the exported model, the same labels
    from meshforge.data import build_source

    src = build_source(config(["data.source=dataset", f"data.paths=[{PC}]", "data.format=prompt_completion",
                               "data.loss_on=all", *DATA, "training.seq_len=32"]).data, 32, 320, 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    x, y = (torch.from_numpy(a) for a in src.batch(list(range(src.num_samples))))
    with torch.no_grad():
        logits = model(x).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum",
                                           ignore_index=-100)
    n = int((y != -100).sum())
    assert got["tokens"] == n and got["samples"] == src.num_samples
    assert got["loss"] == pytest.approx(float(ce) / n, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(float(ce) / n), rel=1e-5)


def test_lm_eval_accuracy_equals_hflm_on_the_export(trained):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from meshforge.evaluation.harness import make_lm, run_tasks
    from meshforge.evaluation.model import load_eval_model

    run, hf, tasks = trained
    ours = make_lm(load_eval_model(str(run)))
    theirs = HFLM(pretrained=str(hf), device="cpu", batch_size=4, dtype="float32")
    a = run_tasks(ours, ["tiny_mc"], [str(tasks)])
    b = run_tasks(theirs, ["tiny_mc"], [str(tasks)])
    print(f"tiny_mc: meshforge {a['tiny_mc']} HFLM {b['tiny_mc']}")
    assert a["tiny_mc"]["acc"] == b["tiny_mc"]["acc"] and a["tiny_mc"]["acc_norm"] == b["tiny_mc"]["acc_norm"]
    # the scores under the accuracy: each choice's log-likelihood, and a rolling (perplexity) one
    docs = [json.loads(x) for x in (tasks / "mc.jsonl").read_text().splitlines()]
    reqs = [Instance("loglikelihood", d, (d["prompt"], " " + c), i) for i, d in enumerate(docs) for c in d["choices"]]
    for (s1, g1), (s2, g2) in zip(ours.loglikelihood(reqs), theirs.loglikelihood(reqs)):
        assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-4) and g1 == g2
    text = PC.read_text()[:3000]  # longer than the model's context: several rolling windows
    roll = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(roll)[0] == pytest.approx(theirs.loglikelihood_rolling(roll)[0], rel=1e-4)
    gen = [Instance("generate_until", {}, (docs[0]["prompt"], {"until": ["\n"], "max_gen_toks": 8}), 0)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)


def test_eval_bad_input_is_one_line(trained, tmp_path, capsys):
    run, _, tasks = trained
    cases = [
        (["eval", str(run)], "nothing to evaluate"),
        (["eval", str(run), "optimizer.lr=1"], "optimizer.lr is not read"),
        (["eval", str(tmp_path / "nope"), "data.source=text"], "does not exist"),
        (["eval", str(run), "data.source=dataset", f"data.paths=[{PC}]", "training.seq_len=100000"],
         "exceeds the model's max_seq_len"),
        (["eval", str(run), "--tasks", "no_such_task", "--include", str(tasks)], "'no_such_task' is not in --include"),
        (["eval", str(run), "data.source=text", f"data.paths=[{PC}]", f"--output={PC}"], "does not overwrite"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert lines and any(message in ln for ln in lines) and "Traceback" not in err, (argv, err)
