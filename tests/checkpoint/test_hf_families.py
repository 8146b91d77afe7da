"""Hugging Face dense families against the real transformers: import -> logits, export -> from_pretrained with
no warnings, same logits, same greedy tokens; config.json keys honoured or refused; published parameter counts.

Every model is built locally from a config with every tensor randomised (norms and biases too, so a dropped
or zero-initialised tensor cannot hide behind its default value).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from meshforge.checkpoint.hf import export_checkpoint, hf_model_args, load_hf_into, save_weights_only  # noqa: E402
from meshforge.cli import main as cli_main  # noqa: E402
from meshforge.errors import CheckpointError  # noqa: E402
from meshforge.models import PRESETS, build_model  # noqa: E402
from meshforge.testing.group import Job  # noqa: E402
from meshforge.testing.parity import config, run_in_group, single_info  # noqa: E402
from meshforge.training.trainer import train  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
# name -> (config class, its keys, safetensors shard size): both rope layouts, llama3 scaling where it matters
# (sequences of 40 > 16 original positions), biases, QK-norm, tied and untied, head_dim != hidden/heads, sharded
CASES = {
    "llama3.1": ("LlamaConfig", dict(attention_bias=True, head_dim=24,
                                     rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE}), None),
    "llama3.2-old-layout-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=50000.0,
                                                     rope_scaling=LLAMA3_ROPE), "40KB"),
    "qwen2.5": ("Qwen2Config", dict(rope_theta=1e6), "40KB"),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), None),
    "mistral": ("MistralConfig", dict(sliding_window=64, rope_theta=1e6), None),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02), None),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True, head_dim=32), "40KB"),
}


def hf_random_model(cls: str, extra: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**SHAPE, **extra}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.float().eval()


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def greedy(model, tokens: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        with torch.no_grad():
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


@contextlib.contextmanager
def transformers_messages():
    """Everything transformers says while loading: its logger (the LOAD REPORT), Python warnings, stdout/err."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    out = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(out):
            warnings.simplefilter("always")
            yield buf
    finally:
        logger.removeHandler(handler)
    buf.write("".join(f"{w.category.__name__}: {w.message}\n" for w in caught))
    buf.write("\n".join(line for line in out.getvalue().splitlines() if "Loading weights" not in line))


@pytest.mark.parametrize("case", list(CASES))
def test_family_import_export_against_transformers(case, tmp_path):
    cls, extra, shard = CASES[case]
    hf = hf_random_model(cls, extra)
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    args = hf_model_args(tmp_path / "hf")
    ours = build_model(args)
    load_hf_into(ours, tmp_path / "hf")
    ours.eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    diff = (ref - got).abs().max().item()
    print(f"{case}: import max |logit diff| {diff:.2e} (logits up to {ref.abs().max():.1f})")
    assert diff < 1e-4
    if args.rope_type == "llama3":  # the scaling matters at this length: without it the logits differ
        plain = build_model(type(args)(**{**args.__dict__, "rope_type": "default"}))
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (plain(tokens) - ref).abs().max().item() > 1e-3

    back = export_and_reload(ours, tmp_path, type(hf).__name__)
    with torch.no_grad():
        assert (back(tokens).logits - got).abs().max().item() < 1e-4
    gen = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
    prompt = tokens[:, :6]
    theirs = back.generate(prompt, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, greedy(ours, prompt, 10))


def export_and_reload(ours, tmp_path: Path, architecture: str):
    """`ours` (imported from tmp_path/hf) exported to tmp_path/out and loaded by transformers: no message, the same
    class, bit-for-bit the tensors transformers saved (permutations and stacking undone)."""
    ck = save_weights_only(ours, tmp_path / "ck")
    export_checkpoint(ck, tmp_path / "out", shard_mb=1)
    with transformers_messages() as said:
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert said.getvalue().strip() == "", said.getvalue()
    assert type(back).__name__ == architecture
    exported, original = load_dir(tmp_path / "out"), load_dir(tmp_path / "hf")
    assert exported.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
    return back


def _hf_dir(tmp_path: Path, cls="LlamaConfig", **extra) -> Path:
    hf_random_model(cls, extra).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _edit_config(d: Path, **changes) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize(("change", "expected"), [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"some_new_key": 1}, "key 'some_new_key' is not read"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "'partial_rotary_factor'"),
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
])
def test_config_json_refusals_exit_2_one_line(change, expected, tmp_path, capsys):
    d = _hf_dir(tmp_path)
    _edit_config(d, **change)
    capsys.readouterr()
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_qwen_sliding_layers_and_unused_tensor_refused(tmp_path, capsys):
    d = _hf_dir(tmp_path, "Qwen2Config")
    _edit_config(d, use_sliding_window=True)
    capsys.readouterr()
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 2
    assert "use_sliding_window=true" in capsys.readouterr().err
    _edit_config(d, use_sliding_window=False)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor model.layers.0.self_attn.rotary_emb.inv_freq is not a parameter" in err


def test_cli_import_prints_values_init_from_matches_them_and_refuses_others(tmp_path, capsys):
    """`checkpoint import` prints the model.* values; `model.init_from` with them trains from the same weights
    as `checkpoint.resume` of the import; with other values (here: no QK-norm) it exits 2 with one line."""
    d = _hf_dir(tmp_path, "Qwen3Config", head_dim=32, max_position_embeddings=64)
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    values = [v for v in line.split()[3:] if v.startswith("model.")]
    assert "model.family=qwen3" in values and "model.qk_norm=True" in values and "model.head_dim=32" in values
    info = single_info()
    a = train(config(values + [f"model.init_from={d}", f"run.output_dir={tmp_path}/a", "data.source=synthetic"],
                     2), info)
    b = train(config(values + [f"checkpoint.resume={tmp_path}/imp", f"run.output_dir={tmp_path}/b",
                               "data.source=synthetic"], 2), info)
    assert a.losses == b.losses
    wrong = [v for v in values if not v.startswith("model.qk_norm")]
    with pytest.raises(CheckpointError, match=r"describes another model: qk_norm=True \(run: False\)"):
        train(config(wrong + [f"model.init_from={d}", f"run.output_dir={tmp_path}/c", "data.source=synthetic"], 2),
              info)


def test_registered_families_are_transformers_causal_lms():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from meshforge.models.hf_families import FAMILIES

    assert {n: f.architecture for n, f in FAMILIES.items()} == {n: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[n] for n in FAMILIES}


# published parameter counts (the models' safetensors totals)
PUBLISHED = {"llama3_2_1b": 1_235_814_400, "llama3_2_3b": 3_212_749_824, "llama3_1_8b": 8_030_261_248,
             "qwen2_5_0_5b": 494_032_768, "qwen2_5_7b": 7_615_616_512, "qwen3_8b": 8_190_735_360,
             "mistral_7b": 7_248_023_552, "mixtral_8x7b": 46_702_792_704, "qwen3_30b_a3b": 30_532_122_624,
             "deepseek_v3": 671_026_404_352}  # DeepSeek-V3's 671B (its 685B with the MTP module, not built here)


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_counts_match_published_and_transformers(preset):
    args = PRESETS[preset]
    ours = sum(p.numel() for p in build_model(args, device="meta").parameters())
    config_json = build_model(args, device="meta").state_dict_adapter().hf_config(torch.bfloat16)
    cfg = transformers.AutoConfig.for_model(**config_json)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    assert ours == theirs == PUBLISHED[preset]


# ------------------------------------------------------------------- MoE export from expert-parallel runs
# A Mixtral-family tiny MoE trained 2 steps at N=2 with EP2 and with fsdp2 x EP2 (experts sharded over the
# ranks), checkpointed; the test exports each checkpoint and transformers must reproduce the trained weights.
EP_OUT = Path(tempfile.mkdtemp(prefix="meshforge-hf-ep-"))
MIXTRAL_TINY = ["model.preset=tiny_moe", "model.family=mixtral", "model.n_shared_experts=0"]
EP_RUNS = {"ep2": ["distributed.ep_size=2"],
           "fsdp2_ep2": ["distributed.strategy=fsdp2", "distributed.ep_size=2"]}


def ep_export_job(spec: dict, info) -> dict:
    out = {}
    for name, extra in EP_RUNS.items():  # the directory comes from the launching process (spec)
        res = run_in_group(MIXTRAL_TINY + extra + [f"run.output_dir={spec['out']}/{name}", "checkpoint.interval=2"],
                           2, info)
        out[name] = res.get("weights")
    return out


# Sharded loading: `model.init_from` into fsdp2 / TP2 / EP2 models at N=2; every sharded parameter must read
# only its slice (no full `get_tensor`), and the loaded weights equal a single-process load.
SLICE_RUNS = {"qwen3-bias fsdp2": ("Qwen3Config", ["distributed.strategy=fsdp2"]),
              # (qwen2, not qwen3: the built-in qk_norm's (head_dim,) weight under TP would get only each rank's
              # heads' gradient, so qk_norm with TP is refused (planning/tp_trace.py))
              "qwen2-bias tp2": ("Qwen2Config", ["distributed.tp_size=2"]),
              "mixtral ep2": ("MixtralConfig", ["distributed.ep_size=2"]),
              "mixtral fsdp2 x ep2": ("MixtralConfig", ["distributed.strategy=fsdp2", "distributed.ep_size=2"])}
SLICE_HF = {"Qwen3Config": dict(vocab_size=256, head_dim=24, attention_bias=True, max_position_embeddings=64),
            "Qwen2Config": dict(vocab_size=256, max_position_embeddings=64),
            "MixtralConfig": dict(vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=64)}


def model_values(d: Path) -> list[str]:
    """The `model.*` overrides that build the model of an HF directory (what `checkpoint import` prints)."""
    args, base = hf_model_args(d), PRESETS["tiny"]
    return [f"model.{k}={json.dumps(getattr(args, k), separators=(',', ':')) if isinstance(getattr(args, k), list) else getattr(args, k)}"
            for k in args.__dataclass_fields__ if getattr(args, k) != getattr(base, k)]


def slice_load_job(spec: dict, info) -> dict:
    """What `model.init_from` does in `Trainer.build` (parallelised model, then `load_hf_into` per part)."""
    from meshforge.distributed.build import build_parallel_model
    from meshforge.distributed.mesh import MeshContext

    out = {}
    for name, (cls, extra) in SLICE_RUNS.items():
        d = Path(spec["out"]) / cls
        cfg = config(model_values(d) + extra + [f"model.init_from={d}", "data.source=synthetic"], 1,
                     info.world_size)
        mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, "cpu")
        pm = build_parallel_model(cfg, mesh_ctx, info.device)
        full_reads = [n for part in pm.unwrapped_parts() for n in load_hf_into(part, d)]
        w = pm.full_state_dict()
        out[name] = {"full_reads": full_reads, "weights": w if info.rank == 0 else None}
    return out


def write_slice_models() -> None:
    """The HF checkpoints of the sliced-load job, written by the launching process (Job.prepare)."""
    for cls, extra in SLICE_HF.items():
        hf_random_model(cls, extra, seed=5).save_pretrained(EP_OUT / cls)


GROUP_JOBS = [Job("hf moe export from ep", f"{Path(__file__).resolve()}:ep_export_job", {"out": str(EP_OUT)}, 2),
              Job("hf sliced load", f"{Path(__file__).resolve()}:slice_load_job", {"out": str(EP_OUT)}, 2,
                  prepare=write_slice_models)]


@pytest.mark.dist
@pytest.mark.parametrize("run", list(EP_RUNS))
def test_moe_export_from_expert_parallel_run(group, run, tmp_path):
    weights = group("hf moe export from ep")[run]
    assert cli_main(["checkpoint", "export", str(EP_OUT / run / "checkpoints"), "--to", str(tmp_path / "hf")]) == 0
    with transformers_messages() as said:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert said.getvalue().strip() == "", said.getvalue()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = build_model(config(MIXTRAL_TINY).model)
    ours.load_state_dict(weights)
    ours.eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    print(f"{run}: exported Mixtral vs trained meshforge weights, max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    # one file per tensor (shard limit 0): the stacked expert weights are read and written one expert at a time
    import meshforge.checkpoint.hf as hf_mod

    reads = []

    def spy(state, path, no_dist, offsets=None):
        reads.extend((k, tuple(v.shape), offsets is not None) for k, v in state.items())
        return dcp_load(state, path, no_dist, offsets)

    dcp_load = hf_mod.dcp_load
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_mod, "dcp_load", spy)
        export_checkpoint(EP_OUT / run / "checkpoints" / "step_2", tmp_path / "per_expert", shard_mb=0)
    expert_reads = [shape for k, shape, boxed in reads if boxed]
    assert expert_reads and all(shape[0] == 1 for shape in expert_reads), reads
    assert not any(".experts." in k and not boxed for k, _, boxed in reads), reads
    index = json.loads((tmp_path / "per_expert" / "model.safetensors.index.json").read_text())["weight_map"]
    e0, e1 = (next(k for k in index if f"experts.{e}.w1" in k) for e in (0, 1))
    assert index[e0] != index[e1]
    per_expert = load_dir(tmp_path / "per_expert")
    assert per_expert.keys() == load_dir(tmp_path / "hf").keys()
    assert all(torch.equal(per_expert[k], v) for k, v in load_dir(tmp_path / "hf").items())


def test_export_of_a_byte_level_run_has_an_equivalent_tokenizer(tmp_path, capsys):
    """data.source=text trains on bytes: the export's tokenizer.json encodes text to exactly those ids (and a
    synthetic-data run, which has no tokenizer, writes none)."""
    for source in ("text", "synthetic"):
        train(config([f"data.source={source}", f"data.max_files={1 if source == 'text' else 'null'}", f"run.output_dir={tmp_path}/{source}",
                      "checkpoint.interval=1"], 1), single_info())
        assert cli_main(["checkpoint", "export", f"{tmp_path}/{source}/checkpoints", "--to",
                         f"{tmp_path}/{source}-hf"]) == 0
    assert not (tmp_path / "synthetic-hf" / "tokenizer.json").exists()
    with transformers_messages() as said:
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "text-hf")
    assert said.getvalue().strip() == "", said.getvalue()
    text = "def f(x):\n\treturn 'héllo' + \"日本\"\x00 end "
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.decode(ids) == text


@pytest.mark.dist
@pytest.mark.parametrize("run", list(SLICE_RUNS))
def test_sharded_init_from_reads_only_slices(group, run):
    got = group("hf sliced load")[run]
    d = EP_OUT / SLICE_RUNS[run][0]
    ref = build_model(hf_model_args(d))
    load_hf_into(ref, d)
    sd = ref.state_dict()
    assert got["weights"].keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(got["weights"][k], v), k
    # the parameters no rule shards (replicated ones) are read whole; every sharded one only in slices
    print(f"{run}: whole-tensor reads {got['full_reads']}")
    sharded_everywhere = "fsdp2" in run or "megatron" in run
    if sharded_everywhere:
        assert got["full_reads"] == []
    else:
        assert not any("experts" in n or "q_proj" in n or "embed" in n for n in got["full_reads"]), got["full_reads"]


def test_init_from_with_flat_buffer_strategy_and_import_resume_work(tmp_path):
    """megatron_fsdp keeps parameters in flat buffers: `model.init_from` loads into the plain model before they
    exist (same losses as fsdp2's init_from; before: refused, and earlier a segfault copying into a storage-less
    parameter); with a meta-device build it is still refused in one line; import + checkpoint.resume works."""
    d = _hf_dir(tmp_path, "LlamaConfig", vocab_size=256, max_position_embeddings=64)
    values = model_values(d)
    with pytest.raises(CheckpointError, match="has no storage of its own here") as err:
        train(config(values + [f"model.init_from={d}", "distributed.strategy=megatron_fsdp",
                               "model.init_device=meta", f"run.output_dir={tmp_path}/a"], 1), single_info())
    assert "\n" not in str(err.value)
    early = train(config(values + [f"model.init_from={d}", "distributed.strategy=megatron_fsdp",
                                   f"run.output_dir={tmp_path}/a2"], 1), single_info())
    assert cli_main(["checkpoint", "import", str(d), "--to", str(tmp_path / "imp")]) == 0
    a = train(config(values + [f"checkpoint.resume={tmp_path}/imp", "distributed.strategy=megatron_fsdp",
                               f"run.output_dir={tmp_path}/b"], 1), single_info())
    b = train(config(values + [f"model.init_from={d}", f"run.output_dir={tmp_path}/c"], 1), single_info())
    assert a.losses == b.losses == early.losses
