"""DeepSeek-V3 against the real transformers (`DeepseekV3ForCausalLM`, built locally from its own config class, every
tensor randomised: norms, biases and the router's selection bias too): import -> logits within 1e-5 (fp32) and the
same greedy tokens as `generate`; export -> `from_pretrained` with no warnings, no missing or unexpected tensor,
the same logits, bit-equal tensors; config.json keys honoured or refused with one line.

Each option is exercised where it changes the logits (checked: switched off, the logits differ): YaRN on and off,
compressed and plain q, group-limited routing, the selection bias, shared experts, dense-first layers, RoPE on
interleaved pairs and on halves, attention biases, a tied head, both config layouts of RoPE.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from meshforge.checkpoint.hf import hf_model_args, load_hf_into  # noqa: E402
from meshforge.cli import main as cli_main  # noqa: E402
from meshforge.models import build_model  # noqa: E402
from meshforge.models.hf_deepseek_v3 import _ACCEPTED, _MUST_BE, _WHY, FIELDS  # noqa: E402

from test_hf_families import export_and_reload, greedy  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
             q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
             num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=0, routed_scaling_factor=2.5,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0}
# name -> (config keys, safetensors shard size, the options whose switching off must change the logits)
CASES = {
    "yarn-q_lora-groups": (dict(rope_parameters=YARN), None, ["yarn", "groups", "bias"]),
    "plain-q-no-groups-sharded": (dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2), "60KB", []),
    "halves-bias-tied-dense2-old-layout": (dict(rope_interleave=False, attention_bias=True, tie_word_embeddings=True,
                                                first_k_dense_replace=2, norm_topk_prob=False, rope_theta=5e4,
                                                rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"}),
                                           None, ["interleave"]),
}


def hf_random_deepseek(extra: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**{**SHAPE, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.float().eval()


# what switches an option off (on the same weights); "bias": the router's selection bias zeroed
OFF = {"yarn": dict(rope_type="default"), "groups": dict(n_group=1, topk_group=1), "bias": {},
       "interleave": dict(rope_interleave=True)}


def _logits_without(ours, tokens, option: str) -> torch.Tensor:
    other = build_model(dataclasses.replace(ours.args, **OFF[option]))
    other.load_state_dict(ours.state_dict())
    if option == "bias":
        for name, b in other.named_buffers():
            if name.endswith("expert_bias"):
                b.zero_()
    other.eval()
    with torch.no_grad():
        return other(tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_against_transformers(case, tmp_path):
    extra, shard, options = CASES[case]
    hf = hf_random_deepseek(extra)
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    if "old-layout" in case:  # the hub's older config.json: top-level rope_theta + rope_scaling
        c = json.loads((tmp_path / "hf" / "config.json").read_text())
        rope = c.pop("rope_parameters")
        c.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
        (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    args = hf_model_args(tmp_path / "hf")
    ours = build_model(args)
    load_hf_into(ours, tmp_path / "hf")
    ours.eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    diff = (ref - got).abs().max().item()
    print(f"{case}: import max |logit diff| {diff:.2e} (logits up to {ref.abs().max():.1f})")
    assert diff < 1e-5
    for option in options:  # the option is live: without it the logits differ
        assert (_logits_without(ours, tokens, option) - ref).abs().max().item() > 1e-3, option

    back = export_and_reload(ours, tmp_path, "DeepseekV3ForCausalLM")  # no warning, tensors bit-equal
    with torch.no_grad():
        assert (back(tokens).logits - got).abs().max().item() < 1e-5
    prompt = tokens[:, :6]
    theirs = back.generate(prompt, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, greedy(ours, prompt, 10))
    # round trip: the export imported again is the same model, bit for bit
    again = build_model(hf_model_args(tmp_path / "out"))
    load_hf_into(again, tmp_path / "out")
    assert again.args == args
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(),
                                                    strict=True))


def _hf_dir(tmp_path: Path, **extra) -> Path:
    hf_random_deepseek(extra).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.parametrize(("change", "expected"), [
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1 is not supported: multi-token prediction"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantization_config="),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_type='llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.5}},
     "rope parameter 'partial_rotary_factor'"),
    ({"aux_loss_alpha": 0.001}, "aux_loss_alpha=0.001 is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported (only 'sigmoid')"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16 disagrees"),
    ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
    ({"some_new_key": 1}, "key 'some_new_key' is not read"),
])
def test_config_json_refusals_exit_2_one_line(change, expected, tmp_path, capsys):
    d = _hf_dir(tmp_path)
    c = json.loads((d / "config.json").read_text())
    c.update(change)
    (d / "config.json").write_text(json.dumps(c))
    capsys.readouterr()
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_original_code_keys_are_honoured_or_accepted(tmp_path):
    """The keys DeepSeek's own config.json carries for its remote code: accepted at their only meaning."""
    d = _hf_dir(tmp_path)
    c = json.loads((d / "config.json").read_text())
    c.update({"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "ep_size": 1,
              "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "pretraining_tp": 1})
    (d / "config.json").write_text(json.dumps(c))
    assert hf_model_args(d).family == "deepseek_v3"


def test_docs_list_every_key():
    """docs/hf.md's DeepSeek-V3 section names every key the family reads, accepts or refuses by name."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "hf.md").read_text()
    section = text[text.index("### DeepSeek-V3"):]
    section = section[:section.index("\n## ")]
    honoured = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                "norm_topk_prob", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "rope_interleave",
                "attention_bias", "head_dim", "qk_head_dim", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "attention_factor", "truncate", "original_max_position_embeddings", "factor", "pad_token_id",
                "bos_token_id", "eos_token_id"]
    for key in [*honoured, *_ACCEPTED, *_MUST_BE, *_WHY]:
        assert f"`{key}`" in section, key
    for field in FIELDS:  # and the model.* field each becomes
        assert f"`model.{field.name}`" in section, field.name


def test_lora_on_latent_attention_and_experts_exports_to_peft(tmp_path):
    """LoRA on every latent-attention projection and the routed experts (tiny_deepseek, 2 steps from a transformers
    base): PEFT loads the `--adapter` export onto the transformers model with the same logits, the `--merge` export
    equals it, and `peft.init_from` reads the folder back."""
    import peft

    from meshforge.models import resolve_model_args
    from meshforge.models.hf_families import dense_adapter
    from meshforge.testing.parity import config, single_info
    from meshforge.training.trainer import Trainer

    shape = ["model.preset=tiny_deepseek"]
    hcfg = dense_adapter(resolve_model_args(config(shape).model)).hf_config()
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{k: v for k, v in hcfg.items() if k != "architectures"})).save_pretrained(tmp_path / "base")
    ov = [*shape, f"model.init_from={tmp_path / 'base'}", "peft.rank=4", "peft.alpha=8",
          "peft.target_modules=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,'experts.*']"]
    tr = Trainer.build(config([*ov, "checkpoint.interval=2", f"run.output_dir={tmp_path / 'run'}"], steps=2,
                              world_size=1), single_info())
    tr.fit()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = tr.pm.model.eval()(tokens)
    ck = tmp_path / "run" / "checkpoints" / "step_2"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp_path / "merged"), "--merge"]) == 0
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]
    assert saved["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    print(f"deepseek_v3 LoRA: peft moved the logits by {(theirs - base_logits).abs().max():.2e}; |peft - meshforge| "
          f"{(theirs - ours).abs().max():.2e}, |merged - peft| {(merged - theirs).abs().max():.2e}")
    assert (theirs - base_logits).abs().max() > 1e-3
    assert (theirs - ours).abs().max() < 1e-4
    assert (merged - theirs).abs().max() < 1e-4
    back = Trainer.build(config([*ov, f"peft.init_from={tmp_path / 'adapter'}"], steps=1, world_size=1),
                         single_info())
    with torch.no_grad():
        assert (back.pm.model.eval()(tokens) - ours).abs().max() < 1e-5
