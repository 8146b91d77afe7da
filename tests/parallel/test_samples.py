"""Samples during training (`logging.samples`): they change nothing about training (losses and weights bitwise equal
to the same run without them, sampled or greedy), exact resume still holds with them on, the text is the same at
any parallelism (greedy, on weights whose logits are well separated: model.init_std=0.2) and the same as
`meshforge generate` gives from the run's checkpoint, including one saved by a 2-process TP run (resharded on
load), on one process and tensor-parallel over two (`--nproc-per-node 2`).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from meshforge.cli import main as cli_main
from meshforge.testing.group import Job
from meshforge.testing.parity import config, single_info

pytestmark = pytest.mark.dist

SHARED = Path(os.environ.get("MESHFORGE_TEST_SHARED", "/tmp"))
PROMPTS = ["def f(", "import o"]
BASE = ["data.source=text", "data.max_files=2", "model.init_std=0.2"]
GREEDY = "logging.samples={prompts: ['def f(', 'import o'], every: 3, max_new_tokens: 6}"
SAMPLED = ("logging.samples={prompts: ['def f(', 'import o'], every: 2, max_new_tokens: 6, temperature: 0.9, "
           "top_p: 0.95, seed: 3}")
STEPS = 3
N2 = {"fsdp2": [], "ddp": ["distributed.strategy=ddp"], "megatron_fsdp": ["distributed.strategy=megatron_fsdp"],
      "tp2+sp": ["distributed.tp_size=2", "distributed.sequence_parallel=true",
                 f"run.output_dir={SHARED / 'samples-tp2'}", "checkpoint.interval=3"]}


def samples_job(spec, info) -> dict:
    from meshforge.training.trainer import train

    out = {}
    for name, overrides in spec.items():
        try:
            plain = train(config(BASE + [o for o in overrides if not o.startswith(("run.", "checkpoint."))], STEPS,
                                 info.world_size), info)
            res = train(config(BASE + overrides + [GREEDY], STEPS, info.world_size), info)
            out[name] = {"losses": res.losses, "plain": plain.losses, "samples": res.samples}
        except Exception as err:  # reported to the test
            out[name] = {"error": f"{type(err).__name__}: {err}"}
    return out


def generate_tp_job(spec, info) -> list[dict]:
    """`meshforge generate --nproc-per-node 2` as each launched rank runs it: the TP run's checkpoint, resharded
    into the whole model on every rank and tensor-parallel over both (KV cache per rank's heads)."""
    from meshforge.cli import build_parser
    from meshforge.generation.cli import complete

    args = build_parser().parse_args(["generate", spec, *[a for p in PROMPTS for a in ("-p", p)],
                                      "--max-new-tokens", "6"])
    return complete(args, info)[0]


GROUP_JOBS = [Job("samples n2", f"{Path(__file__).resolve()}:samples_job", N2, 2),
              Job("generate tp2", f"{Path(__file__).resolve()}:generate_tp_job", str(SHARED / "samples-tp2"), 2)]


def _train(extra, steps=STEPS):
    from meshforge.training.trainer import train

    return train(config(BASE + list(extra), steps, world_size=1), single_info())


def _generate(source, capsys, *flags) -> list[str]:
    capsys.readouterr()  # what training printed
    rc = cli_main(["generate", str(source), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "6",
                   "--json", *flags])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return [json.loads(line)["completion"] for line in out.out.splitlines()]


@pytest.fixture(scope="module")
def greedy_single():
    return _train([GREEDY])


def test_samples_change_nothing_and_resume_is_bitwise(tmp_path, capsys):
    ref = _train([], steps=4)
    a = tmp_path / "a"
    first = _train([SAMPLED, f"run.output_dir={a}", "checkpoint.interval=2"], steps=4)
    assert first.losses == ref.losses  # bitwise: sampling touched neither the RNG nor the data order
    assert all(torch.equal(v, ref.parallel_model.full_state_dict()[k])
               for k, v in first.parallel_model.full_state_dict().items())
    assert [r["step"] for r in first.samples] == [2, 4]
    resumed = _train([SAMPLED, f"run.output_dir={tmp_path / 'b'}", f"checkpoint.resume={a / 'checkpoints/step_2'}"],
                     steps=4)
    assert resumed.start_step == 2 and resumed.losses == ref.losses[2:]
    assert resumed.samples == first.samples[1:]  # the same seeded draws from the same weights
    # the same text from the saved checkpoint, one process, KV cache, same sampling seed
    got = _generate(a, capsys, "--temperature", "0.9", "--top-p", "0.95", "--seed", "3")
    assert got == [s["completion"] for s in first.samples[-1]["samples"]]
    # a checkpoint of another model than the config (the run's config.yaml + model.* overrides) says: refused as a
    # resume refuses it, one line, exit 2
    for override, needle in (("model.dim=128", "has shape"), ("model.rope_theta=1000.0", "saved from another model")):
        assert cli_main(["generate", str(a), override, "-p", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_samples_are_the_same_at_any_parallelism(group, greedy_single, capsys):
    results = group("samples n2")
    want = greedy_single.samples
    assert [r["step"] for r in want] == [3] and all(s["completion"] for s in want[0]["samples"])
    bad = []
    for name, got in results.items():
        if "error" in got:
            bad.append(f"{name}: {got['error'][:800]}")
        elif got["losses"] != got["plain"]:
            bad.append(f"{name}: losses with samples {got['losses']} != without {got['plain']}")
        elif got["samples"] != want:
            bad.append(f"{name}: samples {got['samples']} != single process {want}")
    assert not bad, "\n".join(bad)
    # the TP run's checkpoint, resharded into one process, generates the same text (greedy, KV cache), and so does
    # `meshforge generate --nproc-per-node 2` (tensor-parallel over the two ranks)
    assert _generate(SHARED / "samples-tp2", capsys) == [s["completion"] for s in want[0]["samples"]]
    assert [r["completion"] for r in group("generate tp2")] == [s["completion"] for s in want[0]["samples"]]


def test_samples_bad_input_is_one_line():
    from meshforge.config import ConfigError, load_config
    from meshforge.training.trainer import Trainer

    def problems(*overrides, world_size=1):
        with pytest.raises(ConfigError) as err:
            cfg = load_config(None, ["training.device=cpu", *overrides], world_size=world_size)
            Trainer.build(cfg, single_info())
        return err.value.problems

    assert any("top_k/top_p sample, but temperature is 0" in p for p in problems(
        "logging.samples={prompts: [a], every: 2, top_k: 5}"))
    assert any("logging.samples with distributed.pp_size=2 is not supported" in p for p in problems(
        "logging.samples={prompts: [a], every: 2}", "distributed.pp_size=2", "model.n_layers=2", world_size=2))
    assert problems("data.source=synthetic", "logging.samples={prompts: [a], every: 2}") == [
        "logging.samples needs a tokenizer to read its prompts: set data.tokenizer"]
    (long,) = problems("data.source=text", "data.max_files=1", "model.max_seq_len=8", "training.seq_len=8",
                       "logging.samples={prompts: [abcdefghij], every: 2}")
    assert long.startswith("logging.samples prompt 1 is 10 tokens, but the model's context is 8")
