"""LoRA on a `model.hf_model` (issue 30 item 4), against the real transformers and peft:

- The adapter layout is the model's own `nn.Linear` modules by name (Qwen2: q/k/v/o and gate/up/down projections),
  the output head left out; an unknown target is one line.
- Train LoRA from a folder of weights -> adapter checkpoint -> `meshforge checkpoint export --adapter`:
  `peft.PeftModel.from_pretrained` on the transformers base gives the trained model's logits; `--merge` writes a
  transformers folder (save_pretrained) with the same logits; `peft.init_from` reads the PEFT folder back.
- Resume of an adapter checkpoint is exact.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from meshforge.cli import main as cli_main  # noqa: E402
from meshforge.errors import CheckpointError, ConfigError  # noqa: E402
from meshforge.models import build_model, resolve_model_args  # noqa: E402
from meshforge.testing.parity import config, single_info  # noqa: E402
from meshforge.training.trainer import Trainer  # noqa: E402
from tests.checkpoint.test_hf_model import random_qwen2  # noqa: E402
from tests.checkpoint.test_lora_checkpoint import (  # noqa: E402
    _train,
    assert_merge_refuses_changed_base,
    one_byte_changed,
)

LORA = ["peft.rank=4", "peft.alpha=8", "peft.target_modules=['*_proj']", "optimizer.lr=1e-2",
        "checkpoint.interval=2", "training.seq_len=16"]
ATOL = 1e-5  # logits of size ~10: fp32 rounding of the adapted matmuls in another order


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_lora")
    random_qwen2(tmp / "base")
    tr = _train([f"model.hf_model={tmp / 'base'}", *LORA, f"run.output_dir={tmp / 'run'}"])
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = tr.pm.model.eval()(tokens)
    return tmp, tr, tokens, logits


def test_adapter_layout_is_the_models_linears(tmp_path):
    random_qwen2(tmp_path / "base")
    model = build_model(resolve_model_args(config([f"model.hf_model={tmp_path / 'base'}"], world_size=1).model),
                        "meta")
    layout = model.adapter_layout()
    assert layout.linears == {r: f"hf.model.layers.*.{'self_attn' if r[0] in 'qkvo' else 'mlp'}.{r}" for r in
                              ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    assert layout.embeddings == ("hf.model.embed_tokens", "hf.lm_head")
    assert "hf.model.layers.*.input_layernorm" in layout.norms and "hf.model.norm" in layout.norms
    with pytest.raises(ConfigError, match="'wq' matches none of this model's linear layers"):
        config([f"model.hf_model={tmp_path / 'base'}", "peft.target_modules=[wq]"], world_size=1)


def test_only_the_adapters_train(flow):
    tmp, tr, _, _ = flow
    trained = {n for n, p in tr.pm.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * 7 * 2  # 7 projections x 2 layers x (A, B)
    assert tr.result.losses[-1] < tr.result.losses[0]


def test_peft_loads_the_export_and_merge_equals_it(flow):
    tmp, _, tokens, logits = flow
    ck = tmp / "run" / "checkpoints" / "step_4"
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "adapter"), "--adapter"]) == 0
    assert cli_main(["checkpoint", "export", str(ck), "--to", str(tmp / "merged"), "--merge"]) == 0
    cfg = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base").eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        theirs = peft.PeftModel.from_pretrained(base, tmp / "adapter").eval()(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged").eval()(tokens).logits
    assert (logits - base_logits).abs().max() > 1e-2  # the adapters moved the logits
    err, merge_err = (theirs - logits).abs().max().item(), (merged - logits).abs().max().item()
    print(f"hf_model LoRA: PEFT's logits {err:.1e} from meshforge's, merged {merge_err:.1e}")
    assert err < ATOL and merge_err < ATOL


def test_resume_and_peft_init_from(flow):
    tmp, tr, tokens, logits = flow
    base = [f"model.hf_model={tmp / 'base'}", *LORA]
    again = _train([*base, f"run.output_dir={tmp / 'again'}",
                    f"checkpoint.resume={tmp / 'run' / 'checkpoints' / 'step_2'}"])
    assert again.result.losses == tr.result.losses[2:]
    if not (tmp / "adapter").is_dir():
        cli_main(["checkpoint", "export", str(tmp / "run" / "checkpoints" / "step_4"), "--to", str(tmp / "adapter"),
                  "--adapter"])
    loaded = Trainer.build(config([*base, f"run.output_dir={tmp / 'loaded'}", f"peft.init_from={tmp / 'adapter'}"],
                                  steps=1, world_size=1), single_info())
    with torch.no_grad():
        assert (loaded.pm.model.eval()(tokens) - logits).abs().max() < ATOL


def test_a_changed_base_folder_is_refused_on_resume_and_merge(flow, tmp_path, capsys):
    """The model.hf_model folder is a LoRA run's frozen base: the manifest fingerprints it by content, as it does
    model.init_from's, so a resume or a merge onto weights replaced under the same path is refused naming the file."""
    tmp, _, _, _ = flow
    ck = tmp / "run" / "checkpoints" / "step_2"
    inputs = json.loads((ck / "manifest.json").read_text())["model_inputs"]["model.hf_model"]
    assert {k.rpartition("/")[2] for k in inputs["files"]} == {"config.json", "model.safetensors"}
    with one_byte_changed(tmp / "base" / "model.safetensors"):
        with pytest.raises(CheckpointError, match=r"model.hf_model: .*model.safetensors changed since the "
                                                  r"checkpoint \(content\)"):
            _train([f"model.hf_model={tmp / 'base'}", *LORA, f"run.output_dir={tmp_path / 'resumed'}",
                    f"checkpoint.resume={ck}"])
        assert_merge_refuses_changed_base(ck, tmp_path / "merged", capsys)


def test_planning_an_adapted_hf_model_twice_leaves_the_cached_model_alone(tmp_path):
    """The planner adapts a copy of the model validation caches: a second plan in the same process (`--fit`,
    `--compare`, validate then plan) raised "q_proj is a LoRALinear", and a plan without LoRA saw the adapters."""
    from meshforge.planning.params import model_params

    random_qwen2(tmp_path / "base")
    base = [f"model.hf_model={tmp_path / 'base'}", "training.seq_len=16"]
    lora = [*base, "peft.rank=4", "peft.target_modules=['*_proj']"]
    first, again = (model_params(config(lora, world_size=1))[0] for _ in range(2))
    plain = model_params(config(base, world_size=1))[0]
    assert [(p.name, p.trainable) for p in first] == [(p.name, p.trainable) for p in again]
    assert any("lora" in p.name for p in first) and not any("lora" in p.name for p in plain)
    assert all(p.trainable for p in plain) and not all(p.trainable for p in first)
