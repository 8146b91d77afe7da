"""The Hugging Face families by name (dense and mixture-of-experts): `model.family` and config.json's
`model_type` -> the family and its state-dict adapter."""

from __future__ import annotations

from meshforge.errors import CheckpointError
from meshforge.models.hf_dense import DenseFamily, DenseStateDictAdapter
from meshforge.models.hf_llama import LLAMA
from meshforge.models.hf_mistral import MISTRAL
from meshforge.models.hf_mixtral import MIXTRAL
from meshforge.models.hf_moe import MoEFamily, MoEStateDictAdapter
from meshforge.models.hf_qwen2 import QWEN2
from meshforge.models.hf_qwen3 import QWEN3
from meshforge.models.hf_qwen3_moe import QWEN3_MOE
from meshforge.models.presets import ModelArgs

DENSE_FAMILIES: dict[str, DenseFamily] = {f.model_type: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, MIXTRAL,
                                                                    QWEN3_MOE)}


def dense_family(name: str) -> DenseFamily:
    if name not in DENSE_FAMILIES:
        raise CheckpointError(f"config.json: model_type={name!r} is not supported (one of "
                              f"{', '.join(DENSE_FAMILIES)})")
    return DENSE_FAMILIES[name]


def dense_adapter(args: ModelArgs) -> DenseStateDictAdapter:
    family = dense_family(args.family)
    return (MoEStateDictAdapter if isinstance(family, MoEFamily) else DenseStateDictAdapter)(args, family)


def args_from_hf_config(c: dict) -> dict:
    """HF config.json -> meshforge `model.*` values (on top of any preset); refuses what it cannot honour."""
    return dense_family(c.get("model_type", "llama")).read_config(c)
