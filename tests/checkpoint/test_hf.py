"""Hugging Face export/import: permutation, logits equal to an independent rotate_half reference, round trip."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from meshforge.checkpoint.hf import export_checkpoint, load_hf_into, save_weights_only
from meshforge.cli import main as cli_main
from meshforge.errors import CheckpointError
from meshforge.models import init_weights
from meshforge.models.hf_llama import permute_from_hf, permute_to_hf
from meshforge.models.llama import Llama
from meshforge.models.presets import ModelArgs
from meshforge.testing.parity import config, single_info
from meshforge.training.trainer import train

# ~4.4 MiB of fp32 weights: consolidated_shard_mb=1 gives several shards and an index
ARGS = ModelArgs(vocab_size=256, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    model = Llama(ARGS)
    init_weights(model, seed=123)
    ck = save_weights_only(model, tmp / "ck")
    summary = export_checkpoint(ck, tmp / "hf", shard_mb=1)
    return model, tmp, summary


def hf_reference_logits(sd: dict, c: dict, tokens: torch.Tensor) -> torch.Tensor:
    """An independent HF-Llama forward (rotate_half RoPE, repeat_kv GQA) on HF-named tensors."""
    B, S = tokens.shape
    H, KV, hd, eps = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    theta = c["rope_parameters"]["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    mask = torch.full((S, S), float("-inf")).triu(1)
    x = sd["model.embed_tokens.weight"][tokens]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, S, H, hd).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, S, KV, hd).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, S, KV, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(B, S, H * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
            @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def _load_hf_dir(d) -> dict:
    sd = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def test_permute_roundtrip_and_is_not_identity():
    w = torch.randn(4 * 16, 32)
    assert torch.equal(permute_from_hf(permute_to_hf(w, 4), 4), w)
    assert not torch.equal(permute_to_hf(w, 4), w)


def test_export_is_sharded_with_index_and_config(exported):
    model, tmp, summary = exported
    d = tmp / "hf"
    files = sorted(p.name for p in d.glob("*.safetensors"))
    print(summary, files)
    assert summary["files"] == len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in model.parameters())
    c = json.loads((d / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["hidden_size"] == 128 and c["num_key_value_heads"] == 2
    for f in d.glob("*.safetensors"):  # each shard respects the limit unless one tensor alone exceeds it
        assert f.stat().st_size <= 1 * 2**20 + 64 * 1024 or len(load_file(str(f))) == 1


def test_logits_match_rotate_half_reference(exported):
    model, tmp, _ = exported
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        ref = hf_reference_logits(_load_hf_dir(tmp / "hf"), json.loads((tmp / "hf" / "config.json").read_text()),
                                  tokens)
        # without the wq/wk permutation the HF layout would NOT reproduce the model
        sd = _load_hf_dir(tmp / "hf")
        for k in list(sd):
            if "q_proj" in k or "k_proj" in k:
                sd[k] = permute_from_hf(sd[k], 4 if "q_proj" in k else 2)
        wrong = hf_reference_logits(sd, json.loads((tmp / "hf" / "config.json").read_text()), tokens)
    diff = (ours - ref).abs().max().item()
    print(f"meshforge vs HF rotate_half reference: max abs logit diff {diff:.2e}; "
          f"unpermuted {(ours - wrong).abs().max().item():.2e}")
    assert diff < 1e-5
    assert (ours - wrong).abs().max().item() > 1e-3


def test_import_roundtrip_bitwise(exported):
    model, tmp, _ = exported
    fresh = Llama(ARGS)
    init_weights(fresh, seed=999)
    load_hf_into(fresh, tmp / "hf")
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n


def test_import_shape_mismatch_one_line(exported):
    _, tmp, _ = exported
    other = Llama(ModelArgs(vocab_size=256, dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256))
    with pytest.raises(CheckpointError, match=r"config.json describes another model: ffn_dim=384 \(run: 256\)"):
        load_hf_into(other, tmp / "hf")


def test_cli_export_import_and_train_from_them(exported, tmp_path, capsys):
    """CLI export of a checkpoint, CLI import back, then `model.init_from` and `checkpoint.resume` of the import
    start training from identical weights (same first loss), different from a fresh init."""
    _, tmp, _ = exported
    assert cli_main(["checkpoint", "export", str(tmp / "ck"), "--to", str(tmp_path / "hf2"), "--shard-mb", "1"]) == 0
    assert _load_hf_dir(tmp_path / "hf2").keys() == _load_hf_dir(tmp / "hf").keys()
    assert cli_main(["checkpoint", "import", str(tmp_path / "hf2"), "--to", str(tmp_path / "imp")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint.resume=" in out and "model.dim=128" in out
    shape = ["model.dim=128", "model.n_layers=3", "model.ffn_dim=384", "model.max_seq_len=64"]
    info = single_info()
    os.environ.pop("MESHFORGE_FAULT", None)
    a = train(config(shape + [f"model.init_from={tmp_path}/hf2", f"run.output_dir={tmp_path}/a"], 2), info)
    b = train(config(shape + [f"checkpoint.resume={tmp_path}/imp", f"run.output_dir={tmp_path}/b"], 2), info)
    c = train(config(shape + [f"run.output_dir={tmp_path}/c"], 2), info)
    print("first losses: init_from", a.losses[0], "resume(import)", b.losses[0], "fresh", c.losses[0])
    assert b.start_step == 0 and a.losses == b.losses and a.losses[0] != c.losses[0]
    rc = cli_main(["checkpoint", "import", str(tmp_path / "nothing"), "--to", str(tmp_path / "x")])
    assert rc == 2 and capsys.readouterr().err.count("\n") == 1


def test_save_consolidated_every(tmp_path):
    """save_consolidated=every: an HF export next to every checkpoint save, equal to the saved weights."""
    os.environ.pop("MESHFORGE_FAULT", None)
    res = train(config([f"run.output_dir={tmp_path}", "checkpoint.interval=2", "checkpoint.save_consolidated=every"],
                       4), single_info())
    hf = tmp_path / "checkpoints" / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["step_2", "step_4"]
    sd = load_file(str(hf / "step_4" / "model.safetensors"))
    w = res.parallel_model.full_state_dict()
    assert torch.equal(sd["model.layers.1.mlp.down_proj.weight"], w["layers.1.feed_forward.w2.weight"])
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], permute_to_hf(w["layers.0.attention.wq.weight"], 4))
