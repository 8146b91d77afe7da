"""The model families, registered once: `model.family` (= config.json's `model_type`) -> its `Family`.

Each family's module declares it (models/family.py says what a declaration holds); this table is the one
place that lists them, and everything else reads it: the schema's allowed `model.family` values and any
family's own keys (models/args.py), preset validation, `build_model` and the planner (the family names its
model and description), import (`args_from_hf_config`) and export (`dense_adapter`), and docs/hf.md's family
table (tests/unit/test_model_description.py checks it). Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshforge.errors import CheckpointError
from meshforge.models.family import Family, register
from meshforge.models.hf_deepseek_v3 import DEEPSEEK_V3
from meshforge.models.hf_gemma3 import GEMMA3
from meshforge.models.hf_gpt_oss import GPT_OSS
from meshforge.models.hf_llama import LLAMA
from meshforge.models.hf_mistral import MISTRAL
from meshforge.models.hf_mixtral import MIXTRAL
from meshforge.models.hf_qwen2 import QWEN2
from meshforge.models.hf_qwen3 import QWEN3
from meshforge.models.hf_qwen3_moe import QWEN3_MOE

if TYPE_CHECKING:
    from meshforge.models.args import ModelArgs
    from meshforge.models.protocol import StateDictAdapter

# one entry per family, in the order messages and docs list them
FAMILIES: dict[str, Family] = register(LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3, GPT_OSS,
                                       GEMMA3)


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise CheckpointError(f"config.json: model_type={name!r} is not supported (one of "
                              f"{', '.join(FAMILIES)})")
    return FAMILIES[name]


def dense_adapter(args: ModelArgs) -> StateDictAdapter:
    """The built-in model's Hugging Face state-dict adapter, per `model.family`."""
    return family(args.family).adapter(args)


def args_from_hf_config(c: dict) -> dict:
    """HF config.json -> meshforge `model.*` values (on top of any preset); refuses what it cannot honour."""
    return family(c.get("model_type", "llama")).read_config(c)
