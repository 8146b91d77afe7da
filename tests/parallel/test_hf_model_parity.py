"""`model.hf_model`: a transformers model (tiny random Qwen2, qkv biases, built from a config.json written here)
trained at N=2 reproduces the single process under fsdp2, ddp (with activation checkpointing of the
`_no_split_modules` blocks), megatron_fsdp and fsdp2 x TP2 (transformers' own `_tp_plan`).

fp32, same seed and global batch, 2 steps (the second runs on updated, re-synchronised weights); relative loss
difference <= 1e-5 per step, final weights within 5e-5 (the built-in models' tolerances). The random start is
meshforge's seeded `init_spec`, identical on every rank.
"""

import json
import os
from pathlib import Path

import pytest

from meshforge.testing.group import Job
from meshforge.testing.parity import compare, results_of

pytestmark = pytest.mark.dist

LOSS_RTOL, WEIGHT_ATOL, STEPS = 1e-5, 5e-5, 2
TINY_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def tiny_config(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(TINY_QWEN2))
    return where / "config.json"


CONFIG = tiny_config(Path(os.environ.get("MESHFORGE_TEST_SHARED", "/tmp")) / "hf_model_tiny_qwen2")
BASE = [f"model.hf_model={CONFIG}"]
N2 = {
    "fsdp2": ["distributed.strategy=fsdp2"],
    "ddp_ac_full": ["distributed.strategy=ddp", "distributed.activation_checkpointing=full"],
    "megatron_fsdp": ["distributed.strategy=megatron_fsdp"],
    "fsdp2_tp2": ["distributed.strategy=fsdp2", "distributed.tp_size=2"],
}
GROUP_JOBS = [Job("hf_model parity n2", "meshforge.testing.parity:configs_job",
                  {"configs": {k: BASE + v for k, v in N2.items()}, "steps": STEPS}, 2)]


@pytest.mark.parametrize("name", list(N2))
def test_hf_model_parity_n2(reference, group, name):
    compare(reference(BASE, steps=STEPS), results_of(group("hf_model parity n2"))[name], name, LOSS_RTOL,
            WEIGHT_ATOL)
