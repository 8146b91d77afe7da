"""`meshforge generate` and its decoding loop against the real transformers: for every built-in family (tiny random
models built locally from transformers' config classes, every tensor randomised), the greedy tokens of a batch of
prompts of different lengths (left-padded) equal `generate` on the same weights, with the KV cache and without;
seeded sampling is reproducible and independent of the batch; the chat template is applied when the tokenizer has
one; bad input is one line, exit 2. (From a run directory, and from checkpoints saved by other strategies and world
sizes: tests/parallel/test_samples.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshforge.cli import main as cli_main  # noqa: E402
from meshforge.data.tokenizer import train_tokenizer  # noqa: E402
from meshforge.generation.decode import Sampling, generate_ids  # noqa: E402
from meshforge.generation.load import load  # noqa: E402

from test_hf_deepseek_v3 import CASES as DEEPSEEK_CASES  # noqa: E402
from test_hf_deepseek_v3 import hf_random_deepseek  # noqa: E402
from test_hf_families import CASES, hf_random_model  # noqa: E402
from test_hf_layered_families import CASES as LAYERED_CASES  # noqa: E402
from test_hf_layered_families import hf_model as hf_layered_model  # noqa: E402

PROMPTS = [[5, 9, 11, 3, 7, 20, 21], [4, 8], [30, 31, 32, 33]]  # different lengths: left padding
NEW = 12
FAMILY_MODELS = {**{n: (lambda c=c, e=e: hf_random_model(c, e)) for n, (c, e, _) in CASES.items()},
                 **{f"deepseek_v3 {n}": (lambda e=e: hf_random_deepseek(e)) for n, (e, _, _) in DEEPSEEK_CASES.items()},
                 # sliding windows shorter than prompt + new tokens, attention sinks, per-layer RoPE, soft-capped logits
                 **{n: (lambda c=c, e=e: hf_layered_model(c, e)) for n, (c, e, *_) in LAYERED_CASES.items()}}
CPU = torch.device("cpu")


def _transformers_greedy(hf) -> list[list[int]]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    hf.generation_config.eos_token_id = None  # run every step (random weights may hit eos early)
    return hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0)[:, width:].tolist()


@pytest.mark.parametrize("name", list(FAMILY_MODELS))
def test_greedy_tokens_equal_transformers_generate(name, tmp_path):
    hf = FAMILY_MODELS[name]()
    hf.save_pretrained(tmp_path)
    want = _transformers_greedy(hf)
    m = load(str(tmp_path), [], None, CPU)
    for cache in (True, False):
        got = generate_ids(m.model, PROMPTS, NEW, Sampling(), set(), m.context, use_cache=cache)
        assert got == want, f"{name} (KV cache {cache}): {got} != transformers {want}"


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A Llama folder with a BPE tokenizer (ChatML template) and a small context."""
    d = tmp_path_factory.mktemp("chat")
    text = d / "corpus.txt"
    text.write_text("def main():\n    return 42\n" * 50)
    train_tokenizer([str(text)], 300, str(d / "model"))
    hf = hf_random_model("LlamaConfig", dict(vocab_size=320, max_position_embeddings=48))
    hf.save_pretrained(d / "model")
    return d / "model"


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli_main(["generate", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_seeded_sampling_is_reproducible_and_batch_independent(chat_folder):
    m = load(str(chat_folder), [], None, CPU)
    s = Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=5)
    both = generate_ids(m.model, PROMPTS, NEW, s, set(), m.context)
    assert both == generate_ids(m.model, PROMPTS, NEW, s, set(), m.context)
    assert both[1] == generate_ids(m.model, PROMPTS[1:2], NEW, s, set(), m.context)[0]  # alone: the same text
    assert both != generate_ids(m.model, PROMPTS, NEW, Sampling(1.0, 50, 0.9, seed=6), set(), m.context)
    greedy = generate_ids(m.model, PROMPTS, NEW, Sampling(), set(), m.context)
    assert generate_ids(m.model, PROMPTS, NEW, Sampling(1.0, top_k=1), set(), m.context) == greedy
    assert generate_ids(m.model, PROMPTS, NEW, Sampling(1.0, top_p=1e-6), set(), m.context) == greedy
    first = greedy[0][3]  # a stop token ends its row there (kept), the others go on
    stopped = generate_ids(m.model, PROMPTS, NEW, Sampling(), {first}, m.context)
    assert stopped[0] == greedy[0][:4] and stopped[0][-1] == first


def test_cli_chat_template_prompts_file_and_json(chat_folder, tmp_path, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(str(chat_folder))
    rc, out, err = _run(capsys, chat_folder, "-p", "hello", "--max-new-tokens", "4", "--json")
    assert rc == 0, err
    (rec,) = map(json.loads, out.splitlines())
    assert rec["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(rec["ids"]) <= 4 and "KV cache" in err
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}))
    rc, out, err = _run(capsys, chat_folder, "--prompts-file", f, "--no-chat", "--max-new-tokens", "3", "--json")
    recs = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and recs[0]["prompt_ids"] == tok.encode("hello", add_special_tokens=False)
    assert recs[1]["prompt_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")  # messages: always the template


def test_bad_input_is_one_line_exit_2(chat_folder, tmp_path, capsys):
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"text": "no prompt key"}\n')
    cases = {
        "no prompt": ([chat_folder], "no prompt: give --prompt TEXT"),
        "too long": ([chat_folder, "--no-chat", "-p", "def main(): return 42 " * 12],
                     "but the model's context is 48"),
        "chat without a template": ([chat_folder, "--chat", "-p", "hi", "--tokenizer", chat_folder / "tokenizer.json"],
                                    "chat asked for, but the tokenizer"),
        "greedy with top-k": ([chat_folder, "-p", "hi", "--top-k", "5"], "temperature is 0 (greedy)"),
        "top-p out of range": ([chat_folder, "-p", "hi", "--temperature", "1", "--top-p", "0"], "--top-p=0.0 must be"),
        "jsonl shape": ([chat_folder, "--prompts-file", bad_jsonl], "line 1: not an object with a string `prompt`"),
        "zero new tokens, before a launch": ([chat_folder, "-p", "hi", "--max-new-tokens", "0", "--nproc-per-node",
                                              "2"], "--max-new-tokens=0 must be at least 1"),
        "missing": ([tmp_path / "nope", "-p", "hi"], "no such file or directory"),
        "not a model": ([tmp_path, "-p", "hi"], "not a checkpoint, a run directory with one"),
        "an override on a folder": ([chat_folder, "model.dim=8", "-p", "hi"], "a Hugging Face folder's model is"),
    }
    for name, (argv, needle) in cases.items():
        rc, out, err = _run(capsys, *argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, err)
        assert "Traceback" not in err
    hf = hf_random_model("LlamaConfig", {})
    hf.save_pretrained(tmp_path / "no-tok")
    rc, _, err = _run(capsys, tmp_path / "no-tok", "-p", "hi")
    assert rc == 2 and "names no tokenizer: pass --tokenizer" in err


def test_each_launched_rank_gets_the_same_command():
    """`--nproc-per-node N` relaunches `meshforge generate` on every rank with every other flag as given."""
    from meshforge.cli import build_parser
    from meshforge.generation.cli import rank_argv

    argv = ["generate", "run", "model.rope_theta=5.0", "-p", "a b", "--prompt", "c", "--prompts-file", "f.txt",
            "--no-chat", "--max-new-tokens", "7", "--temperature", "0.5", "--top-k", "3", "--top-p", "0.9", "--seed",
            "4", "--no-cache", "--tokenizer", "t.json", "--device", "cpu", "--dtype", "bf16", "--json",
            "--nproc-per-node", "2"]
    parser = build_parser()
    args = parser.parse_args(argv)
    again = parser.parse_args(rank_argv(args))
    assert {**vars(again), "nproc_per_node": 2, "fn": None} == {**vars(args), "fn": None}
