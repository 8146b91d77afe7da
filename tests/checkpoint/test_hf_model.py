"""`model.hf_model` (any transformers causal LM) against the real transformers, and the tokenizer an export carries.

- A folder with safetensors: meshforge's model gives transformers' logits exactly; a folder with a tensor the
  model does not have is refused.
- Train -> checkpoint -> `meshforge checkpoint export` -> `from_pretrained` loads with nothing said and gives the
  trained model's logits; the folder's tokenizer is carried and its bos/eos reach config.json.
- A built-in model trained with `data.tokenizer` exports that tokenizer (AutoTokenizer encodes like the run).
- `pad_token_id` (HF's padding_idx) is honoured: the padding row gets no gradient, the gradients equal
  transformers' (with tensor parallelism: tests/parallel/test_hf_model_parity.py).
- Refusals, one line each: the keys that do not apply with hf_model, a tp style meshforge cannot map, a missing
  transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshforge.cli import main as cli_main  # noqa: E402
from meshforge.config.loader import apply_overrides, resolve  # noqa: E402
from meshforge.config.rules import check  # noqa: E402
from meshforge.errors import ConfigError  # noqa: E402
from meshforge.models import build_model, init_weights, load_folder_weights, resolve_model_args  # noqa: E402
from meshforge.testing.parity import config, single_info  # noqa: E402
from meshforge.training.trainer import train  # noqa: E402

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def random_qwen2(folder: Path, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny transformers Qwen2 (qkv biases) with every tensor randomised, saved to `folder`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**{**SHAPE, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return model.float().eval()


def tiny_tokenizer(folder: Path) -> None:
    """A BPE tokenizer folder (tokenizer.json + tokenizer_config.json with bos/eos), trained on a few lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def hello(x): return x + 1", "the quick brown fox jumps"] * 20,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(folder)


def test_folder_weights_give_transformers_logits(tmp_path):
    hf = random_qwen2(tmp_path / "m")
    ours = build_model(resolve_model_args(config([f"model.hf_model={tmp_path / 'm'}"], world_size=1).model))
    init_weights(ours, 0)  # what the trainer does first; the folder's weights then replace every value
    assert load_folder_weights(ours)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - hf(tokens).logits).abs().max().item()
    print(f"hf_model folder weights: max |logit diff| vs transformers {diff:.2e}")
    assert diff == 0.0


def test_folder_with_a_tensor_the_model_lacks_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    random_qwen2(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(state, str(f), metadata={"format": "pt"})
    cfg = config([f"model.hf_model={tmp_path / 'm'}", "training.max_steps=1"], world_size=1)
    with pytest.raises(ConfigError, match=r"unexpected keys .*model\.layers\.0\.extra\.weight"):
        train(cfg, single_info())


def test_train_export_from_pretrained_same_logits_and_tokenizer(tmp_path, capsys):
    """A folder (weights + tokenizer, no bos/eos in its config) -> 2 steps -> export -> transformers."""
    random_qwen2(tmp_path / "m", bos_token_id=None, eos_token_id=None)
    tiny_tokenizer(tmp_path / "m")
    cfg = config([f"model.hf_model={tmp_path / 'm'}", f"run.output_dir={tmp_path}/run", "checkpoint.interval=2"], 2,
                 world_size=1)
    res = train(cfg, single_info())
    trained = res.parallel_model.full_state_dict()
    assert cli_main(["checkpoint", "export", f"{tmp_path}/run/checkpoints", "--to", f"{tmp_path}/out"]) == 0
    from tests.checkpoint.test_hf_families import transformers_messages

    with transformers_messages() as said:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert said.getvalue().strip() == "", said.getvalue()
    ours = build_model(resolve_model_args(cfg.model))
    ours.load_state_dict(trained)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - hf(tokens).logits).abs().max().item()
    print(f"hf_model export: max |logit diff| trained vs from_pretrained {diff:.2e}")
    assert diff == 0.0
    assert not torch.equal(trained["hf.lm_head.weight"], random_qwen2(tmp_path / "again").lm_head.weight)  # trained
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert tok("def hello(x)")["input_ids"] == ref("def hello(x)")["input_ids"]
    # resume (DCP) continues exactly: 2 saved steps + 1 equals 3 steps in one go
    resumed = train(config(cfg_overrides := [f"model.hf_model={tmp_path / 'm'}", f"run.output_dir={tmp_path}/run",
                                             "checkpoint.resume=auto"], 3, world_size=1), single_info())
    straight = train(config([*cfg_overrides[:1], f"run.output_dir={tmp_path}/run3"], 3, world_size=1), single_info())
    assert resumed.losses == straight.losses[2:], (resumed.losses, straight.losses)


def test_imported_folder_tokenizer_reaches_the_export(tmp_path):
    """`meshforge checkpoint import` of a folder with a tokenizer, exported again (directly, and after training
    resumed from the import): the tokenizer comes along."""
    from tests.checkpoint.test_hf_families import hf_random_model

    hf_random_model("LlamaConfig", {}).save_pretrained(tmp_path / "m")
    tiny_tokenizer(tmp_path / "m")
    assert cli_main(["checkpoint", "import", str(tmp_path / "m"), "--to", str(tmp_path / "imp")]) == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "imp"), "--to", str(tmp_path / "out")]) == 0
    # and through training: resume from the import (synthetic data, no tokenizer of its own), export again
    from tests.checkpoint.test_hf_families import model_values

    train(config(model_values(tmp_path / "m") + [f"checkpoint.resume={tmp_path}/imp",
                                                 f"run.output_dir={tmp_path}/run", "checkpoint.interval=1"], 1,
                 world_size=1), single_info())
    assert cli_main(["checkpoint", "export", f"{tmp_path}/run/checkpoints", "--to", str(tmp_path / "out2")]) == 0
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    for out in ("out", "out2"):
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / out)
        assert tok("the quick fox")["input_ids"] == ref("the quick fox")["input_ids"]
        assert tok.eos_token == "</s>"


def test_export_carries_a_data_tokenizer(tmp_path):
    """A built-in model trained with data.tokenizer: the export holds that tokenizer, config.json its eos."""
    from meshforge.data.tokenizer import train_tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("def hello(world):\n    return world * 2\n" * 50)
    train_tokenizer([str(text)], 300, str(tmp_path / "tok"))
    train(config(["data.source=text", f"data.paths=[{text}]", f"data.tokenizer={tmp_path / 'tok'}",
                  "model.vocab_size=300", f"run.output_dir={tmp_path}/run", "checkpoint.interval=1"], 1,
                 world_size=1), single_info())
    assert cli_main(["checkpoint", "export", f"{tmp_path}/run/checkpoints", "--to", f"{tmp_path}/out"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    sample = "def hello(world): return <|im_end|>"
    assert tok(sample)["input_ids"] == ref(sample)["input_ids"]
    assert tok.chat_template == ref.chat_template and tok.chat_template
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["eos_token_id"] == ref.eos_token_id is not None


def _problems(overrides: list[str]) -> list[str]:
    raw = apply_overrides({}, ["data.source=synthetic", *overrides])
    try:
        return check(resolve(raw, world_size=None), 2)
    except ConfigError as err:
        return list(err.problems)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hfw") / "m"
    random_qwen2(d)
    return d


@pytest.mark.parametrize("override, key", [
    ("model.dim=64", "model.dim"), ("model.preset=small", "model.preset"), ("model.init_from=/x", "model.init_from"),
    ("training.fused_loss=true", "training.fused_loss"), ("training.fp8.enabled=true", "training.fp8.enabled"),
    ("peft.rank=4", "peft"), ("distributed.pp_size=2", "distributed.pp_size"),
    ("distributed.cp_size=2", "distributed.cp_size"), ("distributed.ep_size=2", "distributed.ep_size"),
    ("distributed.sequence_parallel=true", "distributed.sequence_parallel"),
    ("model.init_device=meta", "model.init_device=meta"),
])
def test_keys_that_do_not_apply_are_refused(weights_dir, override, key):
    extra = ["distributed.tp_size=2"] if "sequence_parallel" in override else []
    problems = _problems([f"model.hf_model={weights_dir}", override, *extra])
    mine = [p for p in problems if p.startswith(key) and "model.hf_model" in p]
    assert len(mine) == 1, problems
    assert "\n" not in mine[0]


def test_packing_is_refused(weights_dir, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    problems = _problems([f"model.hf_model={weights_dir}", "data.source=dataset", f"data.paths=[{tmp_path}/a.jsonl]",
                          "data.format=prompt_completion", "data.packing=true"])
    assert any(p.startswith("data.packing=true is not supported with model.hf_model") for p in problems), problems


def test_a_tp_style_meshforge_cannot_map_is_one_line(weights_dir):
    model = build_model(resolve_model_args(config([f"model.hf_model={weights_dir}"], world_size=1).model), "meta")
    plan = model.tp_plan()  # transformers' Qwen2 plan, in meshforge's styles
    assert plan["hf.lm_head"] == "vocab_output" and plan["hf.model.embed_tokens"] == "vocab_embedding"
    assert plan["hf.model.layers.*.self_attn.q_proj"] == "colwise" and plan["hf.model.layers.*.mlp.down_proj"] == \
        "rowwise"
    model.hf._tp_plan = {**model.hf._tp_plan, "model.layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.gate_proj' style 'local_colwise'.*cannot map"):
        model.tp_plan()


def test_without_transformers_the_key_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **SHAPE}))
    monkeypatch.setitem(sys.modules, "transformers", None)
    problems = _problems([f"model.hf_model={tmp_path}/config.json"])
    assert "model.hf_model needs transformers: pip install 'meshforge[hf]'" in problems


def test_missing_config_is_one_line(tmp_path):
    problems = _problems([f"model.hf_model={tmp_path}"])
    assert any(p.startswith(f"model.hf_model={tmp_path}: no config.json") for p in problems), problems


def test_pad_token_id_gradients_equal_transformers(tmp_path):
    """config.json with pad_token_id imports (no longer refused): logits and embedding/head gradients equal
    transformers' on tokens holding the pad id, whose embedding row gets none."""
    from meshforge.checkpoint.hf import hf_model_args, load_hf_into

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPE, "pad_token_id": 3}))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "m")
    args = hf_model_args(tmp_path / "m")
    assert args.pad_token_id == 3
    ours = build_model(args)
    load_hf_into(ours, tmp_path / "m")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    tokens[:, ::3] = 3
    theirs_logits = hf(tokens).logits
    our_logits = ours(tokens)
    assert (our_logits - theirs_logits).abs().max().item() < 1e-4
    (our_logits.float().square().mean()).backward()
    (theirs_logits.float().square().mean()).backward()
    emb = ours.get_parameter(ours.pipeline_layout().first_stage[0] + ".weight")
    assert emb.grad[3].abs().max().item() == 0.0 and emb.grad[tokens[0, 1]].abs().max().item() > 0
    assert torch.allclose(emb.grad, hf.model.embed_tokens.weight.grad, atol=1e-6)
    assert json.loads(json.dumps(ours.state_dict_adapter().hf_config(torch.float32)))["pad_token_id"] == 3


def test_documented_hf_model_commands_run(tmp_path, monkeypatch):
    """docs/hf.md's `model.hf_model` commands (tiny run -> export -> fine-tune the export), shortened."""
    import re
    import shlex

    root = Path(__file__).resolve().parents[2]
    section = (root / "docs" / "hf.md").read_text().split("## Any transformers model", 1)[1]
    commands = re.findall(r"```bash\n(.*?)```", section, re.S)[0].strip().splitlines()
    assert len(commands) == 3 and "model.hf_model=" in commands[-1]
    monkeypatch.chdir(tmp_path)
    short = ["training.max_steps=2", "training.seq_len=32", "data.max_files=1", "logging.progress=none"]
    for cmd in commands:
        argv = [a.replace("examples/", f"{root}/examples/") for a in shlex.split(cmd)[1:]]
        assert cli_main(argv + (short if argv[0] == "train" else [])) == 0, cmd
    steps = [json.loads(line) for line in (tmp_path / "runs/tiny_cpu_hf_ft/metrics.jsonl").read_text().splitlines()]
    assert any("loss" in s for s in steps)


def test_a_model_that_is_not_causal_is_refused(tmp_path):
    """BERT as AutoModelForCausalLM without is_decoder attends both ways: refused in validation (measured: the last
    token changes earlier logits), never trained on the future; with is_decoder it is causal and validates."""
    bert = {"model_type": "bert", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(bert))
    problems = _problems([f"model.hf_model={tmp_path}/config.json"])
    assert any("BertLMHeadModel is not causal (changing the last token changes the logits before it)" in p
               for p in problems), problems
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({**bert, "is_decoder": True}))
    assert _problems([f"model.hf_model={tmp_path}/d/config.json", "training.seq_len=64"]) == []


def test_pickle_weights_are_refused(tmp_path):
    """A folder whose weights are not safetensors never silently starts from random weights."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"model_type": "qwen2", **SHAPE}))
    (tmp_path / "a" / "pytorch_model.bin").write_bytes(b"")
    problems = _problems([f"model.hf_model={tmp_path}/a"])
    assert any("its weights are pytorch_model.bin, not safetensors" in p for p in problems), problems
