"""GPT-OSS and Gemma 3 text against the real transformers, one case per option: import -> logits within 1e-5
(fp32), each option shown to matter (the model with it changed is far off), packed documents equal to transformers
run document by document, greedy decoding equal to `generate(do_sample=False)`, export -> `from_pretrained` with no
warnings and no missing/unexpected keys, the tensors bit-equal to transformers' own files, the same logits;
config.json keys refused with one line; published parameter counts.

Every model is built from transformers' own config class at the installed version, every tensor randomised (norms,
biases and sinks too), never downloaded.
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
from meshforge.distributed.runtime import packed_positions  # noqa: E402
from meshforge.models import PRESETS, build_model  # noqa: E402

from test_hf_families import export_and_reload, greedy, hf_random_model  # noqa: E402

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
GPT_OSS = dict(SHAPE, num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
GEMMA3 = dict(SHAPE, intermediate_size=80, pad_token_id=0)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 16}


def gpt_oss_published_layout(c: dict) -> dict:
    """config.json as the published GPT-OSS ones write it: rope_theta + rope_scaling, OpenAI's own two keys."""
    rope = dict(c.pop("rope_parameters"))
    return {**c, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope, "experts_per_token":
            c["num_experts_per_tok"], "initial_context_length": rope["original_max_position_embeddings"]}


def gemma3_published_layout(c: dict) -> dict:
    """config.json as Gemma 3 1B's (transformers 4.50): rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern, no layer_types; cache_implementation."""
    rope = c.pop("rope_parameters")
    full = dict(rope["full_attention"])
    c.pop("layer_types")
    return {**c, "rope_theta": full.pop("rope_theta"), "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
            "rope_scaling": full if full.pop("rope_type") != "default" else None,
            "sliding_window_pattern": c.pop("_sliding_window_pattern"), "cache_implementation": "hybrid"}


# name -> (config class, its keys, shard size, {option: the model.* change that must move the logits}, the
# config.json layout written (None: transformers 5's))
CASES = {
    # YaRN (sequences of 40 > 16 original positions), window 8 < 40, sinks, biases; sharded files; published layout
    "gpt_oss yarn window sinks": ("GptOssConfig", dict(GPT_OSS, sliding_window=8, rope_parameters=YARN), "40KB",
                                  {"yarn": {"rope_type": "default"}, "window": {"sliding_window": None,
                                                                                "sliding_window_pattern": None}},
                                  gpt_oss_published_layout),
    # no scaling, no biases, tied, every layer local
    "gpt_oss plain tied local": ("GptOssConfig", dict(GPT_OSS, num_hidden_layers=3, sliding_window=16,
                                                      layer_types=["sliding_attention"] * 3, attention_bias=False,
                                                      rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                                      tie_word_embeddings=True), None,
                                 {"window": {"sliding_window": None}}, None),
    # linear scaling on the global layers, local base, soft-capped logits, query_pre_attn_scalar, window 8, biases
    "gemma3 linear softcap": ("Gemma3TextConfig", dict(GEMMA3, num_hidden_layers=3, sliding_window=8,
                                                       sliding_window_pattern=3, attention_bias=True,
                                                       final_logit_softcapping=5.0, query_pre_attn_scalar=24,
                                                       rope_parameters={
                                                           "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                              "rope_theta": 1e6},
                                                           "sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": 1e4}}), "40KB",
                              {"linear": {"rope_type": "default"}, "softcap": {"final_logit_softcap": None},
                               "window": {"sliding_window": 64}, "local base": {"rope_local_theta": None},
                               "scalar": {"query_pre_attn_scalar": None}}, None),
    # Gemma 3 1B's 5:1 pattern, unscaled, untied, in the published layout
    "gemma3 published layout untied": ("Gemma3TextConfig", dict(GEMMA3, num_hidden_layers=6, sliding_window=8,
                                                                sliding_window_pattern=6, tie_word_embeddings=False,
                                                                rope_theta=5e5, rope_local_base_freq=2e4), None,
                                       {"local base": {"rope_local_theta": None}}, gemma3_published_layout),
}


def hf_model(cls: str, extra: dict, seed: int = 0):
    model = hf_random_model(cls, extra, seed)
    if cls == "Gemma3TextConfig":  # SDPA and eager agree; eager is transformers' reference
        model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_import_export_against_transformers(case, tmp_path):
    cls, extra, shard, options, layout = CASES[case]
    hf = hf_model(cls, extra)
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    if layout is not None:  # the older layout: transformers must read it as the same model
        c = layout(json.loads((tmp_path / "hf" / "config.json").read_text()))
        (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
        assert again.config.rope_parameters == hf.config.rope_parameters
        assert again.config.layer_types == hf.config.layer_types
    args = hf_model_args(tmp_path / "hf")
    ours = build_model(args)
    load_hf_into(ours, tmp_path / "hf")
    ours.eval()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    diff = (ref - got).abs().max().item()
    print(f"{case}: import max |logit diff| {diff:.2e} (logits up to {ref.abs().max():.1f})")
    assert diff < 1e-5
    for option, change in options.items():  # each option matters at this length: without it the logits differ
        other = build_model(dataclasses.replace(args, **change))
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            off = (other.eval()(tokens) - ref).abs().max().item()
        print(f"  without {option}: {off:.2e}")
        assert off > 1e-3, option
    if args.family == "gpt_oss":  # sinks of -1e4 join no softmax: the logits of attention without sinks
        other = build_model(args)
        other.load_state_dict({k: torch.full_like(v, -1e4) if k.endswith("sinks.weight") else v
                               for k, v in ours.state_dict().items()})
        with torch.no_grad():
            off = (other.eval()(tokens) - ref).abs().max().item()
        print(f"  without sinks: {off:.2e}")
        assert off > 1e-3

    # packed documents: the same as transformers run on each document alone
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 30 + [1] * 10])
    with torch.no_grad():
        packed = ours(tokens, packed_positions(docs), docs)
        alone = torch.cat([hf(tokens[b:b + 1, docs[b] == i]).logits for b in range(2) for i in docs[b].unique()], 1)
    packed_diff = (packed.reshape(alone.shape) - alone).abs().max().item()
    print(f"  packed documents vs transformers per document: {packed_diff:.2e}")
    assert packed_diff < 1e-5

    back = export_and_reload(ours, tmp_path, type(hf).__name__)
    assert hf_model_args(tmp_path / "out") == args  # config.json round trip
    with torch.no_grad():
        assert (back(tokens).logits - got).abs().max().item() < 1e-5
    prompt = tokens[:, :6]
    theirs = back.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, greedy(ours, prompt, 12))


def test_gemma3_packed_equals_transformers_packed(tmp_path):
    """Gemma 3 in transformers masks packed documents from restarting position ids: the same as meshforge's."""
    hf = hf_model("Gemma3TextConfig", dict(GEMMA3, num_hidden_layers=2, sliding_window=8, sliding_window_pattern=2))
    hf.save_pretrained(tmp_path)
    ours = build_model(hf_model_args(tmp_path))
    load_hf_into(ours, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 30 + [1] * 10])
    pos = packed_positions(docs)
    with torch.no_grad():
        diff = (hf(tokens, position_ids=pos, use_cache=False).logits - ours.eval()(tokens, pos, docs)).abs().max()
    assert diff.item() < 1e-5


def _hf_dir(tmp_path: Path, cls: str, extra: dict) -> Path:
    hf_model(cls, extra).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


REFUSED = [
    ("GptOssConfig", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config (mxfp4)"),
    ("GptOssConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("GptOssConfig", {"rope_parameters": {**YARN, "mscale": 1.0}}, "'mscale'"),
    ("GptOssConfig", {"experts_per_token": 3}, "experts_per_token=3 disagrees"),
    ("GptOssConfig", {"initial_context_length": 99}, "initial_context_length=99 disagrees"),
    ("GptOssConfig", {"layer_types": ["full_attention", "sliding_attention"]}, "not one period repeated"),
    ("GptOssConfig", {"some_new_key": 1}, "key 'some_new_key' is not read"),
    ("Gemma3TextConfig", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("Gemma3TextConfig", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("Gemma3TextConfig", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("Gemma3TextConfig", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6,
                                                                 "factor": 2.0},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_type='yarn'"),
    ("Gemma3TextConfig", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                              "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4,
                                                                    "factor": 2.0}}},
     "rope_parameters.sliding_attention: rope_type='linear'"),
    ("Gemma3TextConfig", {"sliding_window": None}, "sliding_window is null"),
]


@pytest.mark.parametrize(("cls", "change", "expected"), REFUSED, ids=[f"{c[:6]}-{e[:24]}" for c, _, e in REFUSED])
def test_config_json_refusals_exit_2_one_line(cls, change, expected, tmp_path, capsys):
    d = _hf_dir(tmp_path, cls, dict(GPT_OSS if cls == "GptOssConfig" else dict(GEMMA3, num_hidden_layers=2),
                                    sliding_window=8))
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, **change}))
    capsys.readouterr()
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


# published totals (the models' safetensors, bf16 for GPT-OSS)
PUBLISHED = {"gpt_oss_20b": 20_914_757_184, "gpt_oss_120b": 116_829_156_672, "gemma3_1b": 999_885_952}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_counts_match_published_and_transformers(preset):
    args = PRESETS[preset]
    model = build_model(args, device="meta")
    ours = sum(p.numel() for p in model.parameters())
    cfg = transformers.AutoConfig.for_model(**model.state_dict_adapter().hf_config(torch.bfloat16))
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    assert ours == theirs == PUBLISHED[preset]
