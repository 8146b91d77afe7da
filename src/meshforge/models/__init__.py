"""Plain PyTorch models behind one contract (`protocol.py`); nothing here imports torch.distributed.

This package sits below config and planning: they validate a config against the models' declared plans
(built on the meta device), and the models know nothing of configs beyond duck-typed `model.*` values.
"""

from __future__ import annotations

import zlib
from typing import Any

from meshforge.models.args import ModelArgs
from meshforge.models.hf_families import FAMILIES
from meshforge.models.presets import PRESETS
from meshforge.models.presets import resolve_model_args as resolve_preset
from meshforge.models.protocol import (
    AdapterLayout,
    ForeignModel,
    InitSpec,
    ModelContract,
    PipelineLayout,
    StateDictAdapter,
    blocks_of,
    contract_of,
    set_submodule,
    submodule_or_none,
)

__all__ = ["FAMILIES", "HF_PREFIX", "PRESETS", "AdapterLayout", "ForeignModel", "InitSpec", "ModelArgs",
           "ModelContract", "PipelineLayout", "StateDictAdapter", "args_from_hf_config", "blocks_of", "build_model",
           "contract_of", "hf_config_dict", "init_weights", "load_folder_weights", "meta_modules",
           "persistent_buffers", "plan_layout", "plan_modules", "param_init_tensor", "probe_model",
           "resolve_model_args", "set_submodule", "submodule_or_none"]


def resolve_model_args(model_cfg: Any) -> ModelArgs:
    """The model a `ModelConfig` describes: its preset + overrides, or with `model.hf_model` the transformers
    model's shape read from its config.json (models/hf_auto.py)."""
    if getattr(model_cfg, "hf_model", None):
        from meshforge.models.hf_auto import hf_model_args

        return hf_model_args(model_cfg.hf_model)
    return resolve_preset(model_cfg)


def build_model(model_cfg: Any, device: str | None = None):
    """Build the model a `ModelConfig` (or `ModelArgs`) describes (on `device`, e.g. "meta"; default CPU),
    uninitialised (`init_weights` gives the values)."""
    import contextlib

    import torch

    args = model_cfg if isinstance(model_cfg, ModelArgs) else resolve_model_args(model_cfg)
    if args.hf_model:  # any transformers causal LM (models/hf_auto.py); CPU without a device mode over every op
        from meshforge.models.hf_auto import build_hf_model

        with torch.device(device) if device not in (None, "cpu") else contextlib.nullcontext():
            return build_hf_model(args)
    with torch.device(device or "cpu"), _skip_init_on_meta() if device == "meta" else contextlib.nullcontext():
        return FAMILIES[args.family].model_class(args)(args)


def _skip_init_on_meta():
    """A TorchFunctionMode skipping `torch.nn.init` on meta tensors: there is no data to fill, and the meta
    kernels of the initialisers import torch._dynamo (and with it FSDP), a second of start-up for nothing."""
    from torch.overrides import TorchFunctionMode

    class SkipInitOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__module__", None) == "torch.nn.init":
                tensor = args[0] if args else kwargs.get("tensor")
                if getattr(tensor, "is_meta", False):
                    return tensor
            return func(*args, **kwargs)

    return SkipInitOnMeta()


def meta_modules(model_cfg: Any):
    """(a shallow model on the meta device, {name: module} of the whole model) for process-free checks.

    Every block of a built-in model has the shapes of one of a few blocks (the Llama-style decoder: one; DeepSeek:
    dense and MoE, `Family.stand_ins`), and the blocks live in one container keyed "0", "1", ...: the shallow
    model's blocks stand in for every block under the whole model's names, so a 70B model is described in
    milliseconds and no memory.
    """
    args = resolve_model_args(model_cfg)
    if args.hf_model:  # a transformers model's blocks need not share shapes: the whole model (models/hf_auto.py)
        whole = probe_model(args)
        return whole, dict(whole.named_modules())
    small, stand_in = FAMILIES[args.family].stand_ins(args)
    one = build_model(small, device="meta")
    return one, _whole_model_names(one, one.pipeline_layout().split_points, stand_in)


def plan_modules(model_cfg: Any):
    """`meta_modules` for the planner: a built-in model's torch-free description (models/shapes.py: same names,
    shapes, ties and plans, a shallow model's blocks standing in for every block), so `meshforge plan` never
    imports torch; a `model.hf_model` as validation looks at it (`models.hf_auto.probe_model`)."""
    args = resolve_model_args(model_cfg)
    if args.hf_model:
        return meta_modules(model_cfg)
    family = FAMILIES[args.family]
    small, stand_in = family.stand_ins(args)
    one = family.describe(small)
    return one, _whole_model_names(one, one.pipeline_layout().split_points, stand_in)


def plan_layout(model: Any, block_classes: list[str] | None = None) -> PipelineLayout | None:
    """The structure the planner reads from `plan_modules`' model: the blocks (split points, in forward order) and
    the modules of the model's first and last ends. A built-in model's pipeline layout; a model without one that
    declares `plan_layout` (model.hf_model: the blocks the runtime wraps, `distributed.block_classes` honoured) its
    own; else None."""
    from meshforge.models.shapes import model_contract

    contract = model_contract(model)
    own = getattr(contract, "plan_layout", None)
    return own(block_classes or None) if own is not None else contract.pipeline_layout()


def _whole_model_names(one, blocks: tuple[str, ...], stand_in: tuple[int, ...]) -> dict:
    """{whole-model name: module of the shallow model `one`}: block `blocks[stand_in[i]]`'s modules also under
    block i's names (the blocks share one container)."""
    container = blocks[0].rpartition(".")[0]
    by_block = {}
    for i, j in enumerate(stand_in):
        by_block.setdefault(blocks[j], []).append(f"{container}.{i}")
    modules = {}
    for name, mod in one.named_modules():
        block = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        if block is None:
            modules[name] = mod
            continue
        for whole in by_block.get(block, []):
            modules[whole + name[len(block):]] = mod
    return modules


def persistent_buffers(model) -> list[tuple[str, Any]]:
    """(name, tensor) of the state a model keeps beside its parameters that checkpoints and Hugging Face files hold
    (an MoE router's selection bias), in module order; non-persistent buffers (caches) are not."""
    return [(f"{mname}.{b}" if mname else b, t) for mname, mod in model.named_modules()
            for b, t in mod._buffers.items() if t is not None and b not in mod._non_persistent_buffers_set]


def param_init_tensor(model, name: str, shape, seed: int):
    """The full initial value of parameter `name`: a function of (seed, name) only.

    Because it does not depend on how the model is split or in which order
    parameters are visited, a sharded or pipelined model initialises exactly
    like the single-process one.
    """
    import torch

    from meshforge.models.lora import lora_init_spec

    spec = lora_init_spec(name, tuple(shape)) or contract_of(model).init_spec(name)
    kind, std = spec.kind, spec.std
    if kind == "computed":
        return spec.compute(seed)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=g)


def init_weights(model, seed: int, copy_fn=None, names: dict[str, str] | None = None) -> None:
    """Initialise every parameter of a plain (unsharded) model in place from `param_init_tensor`.

    `copy_fn(param, full)` lets the distributed package write a sharded parameter
    from its full value; the default copies into a plain tensor. `names` maps a parameter to the whole model's
    name it takes its value from (a pipeline stage's copy of a weight tied to another stage's).
    """
    names = names or {}
    import torch

    seen = set()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:  # tied weights: the first name wins
                continue
            seen.add(id(p))
            full = param_init_tensor(model, names.get(name, name), tuple(p.shape), seed)
            if copy_fn is not None:
                copy_fn(p, full)
            else:
                p.copy_(full.to(dtype=p.dtype, device=p.device))


HF_PREFIX = "hf."  # where a model.hf_model's transformers modules live (models/hf_auto.py): its names follow it


def hf_config_dict(path: str) -> dict:
    """A `model.hf_model`'s config as transformers reads it (a plain dict, for a checkpoint's manifest)."""
    from meshforge.models.hf_auto import hf_config

    return hf_config(path).to_dict()


def probe_model(args: ModelArgs):
    """A `model.hf_model` as validation looks at it: in CPU memory when small enough to run (models/hf_auto.py)."""
    from meshforge.models.hf_auto import probe_model as probe

    return probe(args)


def load_folder_weights(model) -> bool:
    """A `model.hf_model` folder's safetensors into the plain model (models/hf_auto.py); False for any other model."""
    from meshforge.models.hf_auto import load_folder_weights as load

    return load(model)


def packing_problem(args: ModelArgs, model=None) -> str | None:
    """Why (one line) this model cannot train packed sequences (`data.packing`), or None: one answer for every
    model. A family's own model declares it (every dense model keeps documents apart through its document mask, an
    MoE model where `Family.packs_documents` says its experts' forward takes the document ids too); a
    `model.hf_model` is measured once it is built (`model`: transformers keeps documents apart only in models that
    build their mask from restarting position ids, models/hf_auto.py; None before)."""
    if args.hf_model:
        from meshforge.models.hf_auto import HFCausalLM

        problem = model.packing_problem() if isinstance(model, HFCausalLM) else None
        return f"data.packing=true with model.hf_model={args.hf_model}: {problem}: set data.packing false" \
            if problem else None
    if args.is_moe and not FAMILIES[args.family].packs_documents:
        packing = [f.name for f in FAMILIES.values() if f.has_experts and f.packs_documents]
        return (f"data.packing=true with a mixture-of-experts model (model.family={args.family}) is not supported "
                f"yet ({' and '.join(packing)} are)")
    return None


def args_from_hf_config(config: dict) -> dict:
    """A Hugging Face config.json -> the `model.*` values of the meshforge model that reads its weights."""
    from meshforge.models.hf_families import args_from_hf_config as read

    return read(config)
