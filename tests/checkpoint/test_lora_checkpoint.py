"""LoRA checkpoints and PEFT interop, single process, against the real transformers and peft libraries.

One flow shared by the tests (module fixture): a random transformers LlamaForCausalLM saved as the base ->
a meshforge LoRA run on it (`model.init_from`) with adapter checkpoints at steps 2 and 4 -> exports.
Per-expert adapters: a random transformers 5 Mixtral / Qwen3-MoE / GPT-OSS base, the experts adapted (PEFT's
`target_parameters`), exported, loaded by peft, merged, and imported back.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from meshforge.checkpoint.safe_dcp import dcp_tensor_shapes
from meshforge.cli import main as cli_main
from meshforge.errors import CheckpointError
from meshforge.models import ModelArgs, resolve_model_args
from meshforge.models.hf_families import dense_adapter
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import Trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def _overrides(tmp, name: str, *extra: str) -> list[str]:
    return [f"model.init_from={tmp / 'base'}", "peft.rank=4", "peft.alpha=8", TARGETS, "checkpoint.interval=2",
            f"run.output_dir={tmp / name}", *extra]


def _train(overrides: list[str], steps: int = 4) -> Trainer:
    tr = Trainer.build(config(overrides, steps=steps, world_size=1), single_info())
    tr.result = tr.fit()
    return tr


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hcfg = dense_adapter(ModelArgs()).hf_config()
    hcfg = {k: v for k, v in hcfg.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**hcfg)).save_pretrained(tmp / "base")
    tr = _train(_overrides(tmp, "run"))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tr.pm.model.eval()(tokens)
    return tmp, tr, tokens, logits


def test_adapter_checkpoint_holds_only_trainable_tensors(flow):
    tmp, tr, _, _ = flow
    ck = tmp / "run" / "checkpoints" / "step_4"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["contents"][0] == "adapter" and manifest["peft"]["rank"] == 4
    model = {k[len("model."):] for k in dcp_tensor_shapes(ck) if k.startswith("model.")}
    trainable = {k for k, p in tr.pm.model.named_parameters() if p.requires_grad}
    assert model == trainable and all(".lora_" in k for k in model)


def test_resume_is_bitwise_exact(flow):
    tmp, tr, _, _ = flow
    again = _train(_overrides(tmp, "again", f"checkpoint.resume={tmp / 'run' / 'checkpoints' / 'step_2'}"))
    assert again.result.start_step == 2 and again.result.losses == tr.result.losses[2:]
    a, b = dict(tr.pm.model.named_parameters()), dict(again.pm.model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change,needle", [
    (["model.dim=128"], "adapters trained on a base with model.dim=64"),
    (["peft.alpha=4"], "saved with peft.alpha=8.0"),
])
def test_resume_onto_another_base_or_adapter_is_one_line(flow, change, needle):
    tmp, _, _, _ = flow
    ov = _overrides(tmp, "other", f"checkpoint.resume={tmp / 'run' / 'checkpoints' / 'step_2'}", *change)
    if "model.dim=128" in change:
        ov = [o for o in ov if not o.startswith("model.init_from")]  # that base has dim 64
    with pytest.raises(CheckpointError) as err:
        _train(ov)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_peft_loads_the_export_and_merge_equals_it(flow, capsys):
    tmp, _, tokens, logits = flow
    ck = tmp / "run" / "checkpoints" / "step_4"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "plain")]) == 2
    assert "--adapter" in capsys.readouterr().err
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "adapter"), "--adapter"]) == 0
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "merged"), "--merge"]) == 0
    base = transformers.LlamaForCausalLM.from_pretrained(tmp / "base").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, tmp / "adapter").eval()
        peft_logits = adapted(tokens).logits
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp / "merged").eval()(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters did train: the comparison means something
    assert (peft_logits - logits).abs().max() < 1e-4
    assert (merged - peft_logits).abs().max() < 1e-4


def test_training_continues_from_a_peft_folder(flow):
    tmp, _, tokens, logits = flow
    if not (tmp / "adapter").is_dir():
        cli_main(["checkpoint", "export", str(tmp / "run" / "checkpoints" / "step_4"), "--to", str(tmp / "adapter"),
                  "--adapter"])
    ov = [o for o in _overrides(tmp, "imported") if not o.startswith("checkpoint")]
    tr = Trainer.build(config([*ov, f"peft.init_from={tmp / 'adapter'}"], steps=1, world_size=1), single_info())
    with torch.no_grad():
        assert (tr.pm.model.eval()(tokens) - logits).abs().max() < 1e-5
    bad = [o for o in ov if not o.startswith("peft.alpha")] + ["peft.alpha=2", f"peft.init_from={tmp / 'adapter'}"]
    with pytest.raises(CheckpointError, match="lora_alpha=8.0 but this run needs 2.0"):
        Trainer.build(config(bad, steps=1, world_size=1), single_info())


def test_training_starts_from_an_adapter_the_peft_library_saved(flow, tmp_path):
    tmp, _, tokens, _ = flow
    base = transformers.LlamaForCausalLM.from_pretrained(tmp / "base")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,  # random B: the adapter changes the logits
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(5)
    theirs = peft.get_peft_model(base, cfg).eval()
    theirs.save_pretrained(tmp_path / "saved_by_peft")
    ov = [o for o in _overrides(tmp, "from_peft") if not o.startswith("checkpoint")]
    tr = Trainer.build(config([*ov, f"peft.init_from={tmp_path / 'saved_by_peft'}"], steps=1, world_size=1),
                       single_info())
    with torch.no_grad():
        want = theirs(tokens).logits
        with theirs.disable_adapter():
            assert (want - theirs(tokens).logits).abs().max() > 1e-3
        assert (tr.pm.model.eval()(tokens) - want).abs().max() < 1e-4


def test_peft_export_keeps_trained_norms_as_modules_to_save(flow):
    tmp, _, tokens, _ = flow
    tr = _train(_overrides(tmp, "norms", "peft.freeze=[embeddings]", "checkpoint.resume=none"), steps=2)
    with torch.no_grad():
        ours = tr.pm.model.eval()(tokens)
    ck = tmp / "norms" / "checkpoints" / "step_2"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "norms_adapter"), "--adapter"]) == 0
    cfg = json.loads((tmp / "norms_adapter" / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["input_layernorm", "norm", "post_attention_layernorm"]
    base = transformers.LlamaForCausalLM.from_pretrained(tmp / "base").eval()
    trained = load_file(str(tmp / "norms_adapter" / "adapter_model.safetensors"))["base_model.model.model.norm.weight"]
    assert (trained - base.model.norm.weight).abs().max() > 1e-3  # the norms did train: PEFT must load them
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(base, tmp / "norms_adapter").eval()(tokens).logits
    assert (theirs - ours).abs().max() < 1e-4
    ov = [o for o in _overrides(tmp, "norms_in") if not o.startswith("checkpoint")]
    back = Trainer.build(config([*ov, "peft.freeze=[embeddings]", f"peft.init_from={tmp / 'norms_adapter'}"],
                                steps=1, world_size=1), single_info())
    with torch.no_grad():
        assert (back.pm.model.eval()(tokens) - ours).abs().max() < 1e-5
    with pytest.raises(CheckpointError, match="modules_to_save=.* set peft.freeze to match"):
        Trainer.build(config([*ov, f"peft.init_from={tmp / 'norms_adapter'}"], steps=1, world_size=1), single_info())


MOE_SHAPES = {"mixtral": ("MixtralForCausalLM", "MixtralConfig", ["model.ffn_dim=64"]),
              "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", ["model.qk_norm=true"]),
              # experts stored fused and interleaved, (E, dim, 2 x hidden), with biases (PEFT: is_transposed)
              "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", ["model.preset=tiny_gpt_oss"])}


@pytest.mark.parametrize("family", list(MOE_SHAPES))
def test_expert_adapters_export_to_peft_merge_and_import(family, tmp_path):
    """Only the experts adapted (so the logits move through them alone): PEFT's ParamWrapper on the fused
    gate_up_proj and down_proj loads the export, the merged export equals it, and the folder imports back."""
    cls, conf, extra = MOE_SHAPES[family]
    shape = ["model.preset=tiny_moe", f"model.family={family}", "model.n_shared_experts=0", *extra]
    hcfg = dense_adapter(resolve_model_args(config(shape).model)).hf_config()
    hcfg = {k: v for k, v in hcfg.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    getattr(transformers, cls)(getattr(transformers, conf)(**hcfg)).save_pretrained(tmp_path / "base")
    ov = [*shape, f"model.init_from={tmp_path / 'base'}", "peft.rank=4", "peft.alpha=8",
          "peft.target_modules=['experts.*']"]
    tr = _train([*ov, "checkpoint.interval=2", f"run.output_dir={tmp_path / 'run'}"], steps=2)
    assert {n.rpartition(".adapters.")[2] for n, p in tr.pm.model.named_parameters() if p.requires_grad} == \
        {"gate_up_proj.lora_A.weight", "gate_up_proj.lora_B.weight", "down_proj.lora_A.weight",
         "down_proj.lora_B.weight"}
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = tr.pm.model.eval()(tokens)
    ck = tmp_path / "run" / "checkpoints" / "step_2"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "merged"), "--merge"]) == 0
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"] and not saved["target_modules"]
    base = getattr(transformers, cls).from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
        merged = getattr(transformers, cls).from_pretrained(tmp_path / "merged").eval()(tokens).logits
    print(f"{family}: peft moved the logits by {(theirs - base_logits).abs().max():.2e}; |peft - meshforge| "
          f"{(theirs - ours).abs().max():.2e}, |merged - peft| {(merged - theirs).abs().max():.2e}")
    assert (theirs - base_logits).abs().max() > 1e-3  # the expert adapters trained: the comparison means something
    assert (theirs - ours).abs().max() < 1e-4
    assert (merged - theirs).abs().max() < 1e-4
    back = Trainer.build(config([*ov, f"peft.init_from={tmp_path / 'adapter'}"], steps=1, world_size=1),
                         single_info())
    with torch.no_grad():
        assert (back.pm.model.eval()(tokens) - ours).abs().max() < 1e-5
    with pytest.raises(CheckpointError, match="target_parameters=.* set peft.target_modules to match"):
        Trainer.build(config([*ov[:-1], "peft.target_modules=['experts.down_proj']",
                              f"peft.init_from={tmp_path / 'adapter'}"], steps=1, world_size=1), single_info())


@pytest.mark.slow
def test_a_base_changed_at_the_same_path_is_refused_on_resume_and_merge(flow, tmp_path, capsys):
    """The manifest fingerprints the base by content: a base replaced under the same path (same size) is named."""
    from meshforge.checkpoint.verify import model_inputs

    tmp, _, _, _ = flow
    ck = tmp / "run" / "checkpoints" / "step_2"
    inputs = json.loads((ck / "manifest.json").read_text())["model_inputs"]["model.init_from"]
    assert inputs["folder"] == str((tmp / "base").resolve())
    assert {k.rpartition("/")[2] for k in inputs["files"]} == {"config.json", "model.safetensors"}
    weights = tmp / "base" / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-3] + bytes([original[-3] ^ 1]) + original[-2:])
        resume = _overrides(tmp, "changed_base", f"checkpoint.resume={ck}")
        with pytest.raises(CheckpointError, match=r"model.init_from: .*model.safetensors changed since the "
                                                  r"checkpoint \(content\).*checkpoint.allow_changed_inputs=true"):
            _train(resume)
        capsys.readouterr()
        assert _train([*resume, "checkpoint.allow_changed_inputs=true"], steps=3).result.start_step == 2
        assert "warning: resuming on changed model inputs" in "".join(capsys.readouterr())
        assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "merged"), "--merge"]) == 2
        err = capsys.readouterr().err
        assert "model.safetensors changed since the checkpoint" in err and "another base" in err
        assert not (tmp_path / "merged").exists()
    finally:
        weights.write_bytes(original)
    adapter = tmp_path / "adapter"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(adapter), "--adapter"]) == 0
    cfg = config([*_overrides(tmp, "x"), f"peft.init_from={adapter}"], steps=1, world_size=1)
    got = model_inputs(cfg)
    assert sorted(k.rpartition("/")[2] for k in got["peft.init_from"]["files"]) == ["adapter_config.json",
                                                                                    "adapter_model.safetensors"]


@pytest.mark.slow
def test_a_merged_export_is_as_complete_as_a_plain_one(flow, tmp_path):
    """Merged LoRA export: loads with AutoTokenizer, GenerationConfig and AutoModelForCausalLM; its files are a plain
    export's (weights aside)."""
    tmp, _, tokens, _ = flow
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i} of a small corpus\n" for i in range(300)))
    tr = _train([*_overrides(tmp_path, "run"), f"model.init_from={tmp / 'base'}", "data.source=text",
                 f"data.paths=[{text}]"], steps=2)  # a run with a tokenizer (byte-level)
    ck = tmp_path / "run" / "checkpoints" / "step_2"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "merged"), "--merge"]) == 0
    plain = tmp_path / "plain"  # the merged model as a full checkpoint of it exports
    assert cli_main(["checkpoint", "import", str(tmp_path / "merged"), "--to", str(tmp_path / "imported")]) == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "imported"), "--to", str(plain)]) == 0
    names = {p.name for p in (tmp_path / "merged").iterdir()}
    assert names == {p.name for p in plain.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert tok("hi")["input_ids"] == [ord("h"), ord("i")]  # the run's byte-level tokenizer
    transformers.GenerationConfig.from_pretrained(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        logits = tr.pm.model.eval()(tokens)
        assert (merged(tokens).logits - logits).abs().max() < 1e-4
