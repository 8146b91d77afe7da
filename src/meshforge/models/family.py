"""The two declarations the model registry collects: one model field (`Arg`) and one family (`Family`).

Torch-free, so the config schema and the planner read them before anything imports torch.

An `Arg` is a `model.*` key once: its type, default, the bound or choices the schema enforces, and one line of
doc. `models/args.py` assembles `ModelArgs` from the shared ones plus each family's own, and the schema
(`config/schema.py`) derives its `model` section from `ModelArgs`, so adding a field is one `Arg` line.

A `Family` is a model meshforge builds natively and reads from / writes to Hugging Face: its module
(`models/hf_<name>.py`) declares one (its name, which is `model.family` and config.json's `model_type`, the
HF architecture class, how config.json maps onto `model.*`, the fields only it reads, the model it builds and
that model's torch-free description), and `models/hf_families.py` registers it with one line. Everything else
reads the registry: the schema's allowed families, preset validation, import and export, `build_model` and
the planner. A family with new blocks (DeepSeek-V3's latent attention, Gemma 3's extra norms) names its own
model class and description here; one that shares the Llama-style decoder keeps the defaults.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from meshforge.models.args import ModelArgs
    from meshforge.models.protocol import StateDictAdapter
    from meshforge.models.shapes import ModelShape


@dataclass(frozen=True)
class Arg:
    """One model field: `ModelArgs.<name>` (the resolved value) and schema key `model.<name>` (an override)."""

    name: str
    type: Any  # as ModelArgs holds it; the schema's key is this or None (None keeps the preset's value)
    default: Any
    doc: str
    gt: float | None = None  # the schema refuses values <= gt
    ge: float | None = None  # the schema refuses values < ge
    choices: tuple[str, ...] = ()  # the schema's allowed values (a Literal), in this order


def _resolve(path: str):
    """"package.module:name" -> the object, imported on first use (a family's model module imports torch)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Family:
    """A Hugging Face family by name. Subclasses (`hf_dense.DenseFamily`, `hf_moe.MoEFamily`) say how its
    config.json maps onto `model.*` (`read_config` / `write_config`), which models it can export
    (`check_args`) and its tensor names (`adapter`)."""

    has_experts: ClassVar[bool] = False  # its model routes tokens to experts (an MoE family)
    name: str  # model.family and config.json's model_type
    architecture: str  # config.json's architectures[0], transformers' class
    fields: tuple[Arg, ...] = ()  # model.* keys only this family reads (added to ModelArgs and the schema)
    # module:function giving the nn.Module class for a ModelArgs (imported only to build: it imports torch), and
    # module:function giving that model's torch-free description (models/shapes.py), which the planner reads
    model: str = "meshforge.models.moe:decoder_class"
    description: str = "meshforge.models.shapes:describe"
    rope_types: tuple[str, ...] = ("default", "llama3")  # the `model.rope_type`s its model computes and exports
    # its model masks sliding windows exactly (per layer, also under context parallelism and packing), so
    # `training.seq_len` may exceed `model.sliding_window` (Mistral's model does not: a rule refuses that)
    exact_windows: bool = False
    # its MoE model's forward masks packed documents and keeps padding out of its router statistics (the default
    # model, models/moe.py's, does; a family with a model of its own says whether its does; every dense model does)
    packs_documents: bool = True

    def model_class(self, args: ModelArgs) -> type:
        return _resolve(self.model)(args)

    def describe(self, args: ModelArgs) -> ModelShape:
        return _resolve(self.description)(args)

    def stand_ins(self, args: ModelArgs) -> tuple[ModelArgs, tuple[int, ...]]:
        """(a shallower model with one layer of each block shape, which of its layers stands for each of `args`'
        layers): the planner describes that model only (a 70B model in milliseconds). Every block of the
        Llama-style decoder has the same shapes: one layer stands for all."""
        return dataclasses.replace(args, n_layers=1), (0,) * args.n_layers

    def validate(self, args: ModelArgs) -> None:
        """Refuse (ValueError, one line naming the key) values this family's model cannot be built with."""

    def read_config(self, config: dict) -> dict:
        """config.json -> `model.*` values; refuses (CheckpointError, one line) any key it cannot honour."""
        raise NotImplementedError

    def write_config(self, args: ModelArgs, dtype: Any) -> dict:
        """`model.*` values -> config.json (`check_args` first)."""
        raise NotImplementedError

    def check_args(self, args: ModelArgs) -> None:
        """Refuse a model this family cannot express (export would write a config that drops a layer)."""
        raise NotImplementedError

    def adapter(self, args: ModelArgs) -> StateDictAdapter:
        """The model's tensor names and layouts <-> the Hugging Face checkpoint's."""
        raise NotImplementedError


_REGISTRY: dict[str, Family] = {}


def register(*families: Family) -> dict[str, Family]:
    """Add families to the registry (models/hf_families.py lists them, once); returns it, in registration order."""
    for f in families:
        if f.name in _REGISTRY and _REGISTRY[f.name] is not f:
            raise ValueError(f"model family {f.name!r} is registered twice")
        _REGISTRY[f.name] = f
    return _REGISTRY


def registered() -> dict[str, Family]:
    """The registered families (models/hf_families.py registers them on import), for a family's own messages."""
    return _REGISTRY
