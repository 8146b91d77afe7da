"""Tensor and sequence parallelism: apply a model's declared TP plan (plus config overrides) with DTensor.

`apply_tp(model, mesh_ctx, dcfg)` runs before context parallelism and before any data-parallel strategy.

The plan is a dict of module-name patterns -> style. Patterns match module names atom by atom
(`layers.*.attention.wq`: `*` is one name component, fnmatch inside a component). The model declares its
plan (`model.tp_plan(sequence_parallel)`); `distributed.tp_plan` from the config is laid over it, module by
module (a config entry wins). A model without `tp_plan` uses the config plan alone.

Styles (torch's `parallelize_module` styles, placed the way torchtitan places them):
- `colwise`: `ColwiseParallel`, weight rows sharded, output a local shard of the features (heads).
- `rowwise`: `RowwiseParallel`, weight columns sharded, output all-reduced (reduce-scattered along the
  sequence, `Shard(1)`, with sequence parallelism).
- `sequence_parallel`: `SequenceParallel` (norms): activations sharded along the sequence on the TP group.
- `sequence_gather` (model plans only, with sequence parallelism): the module's first input arrives sequence
  sharded and is all-gathered once for all the column-wise projections inside (attention, MLP).
- `vocab_embedding`: `RowwiseParallel` on the embedding, vocabulary sharded.
- `vocab_output`: `ColwiseParallel` on the output projection with `use_local_output=False`: the logits stay a
  vocabulary-sharded DTensor and the loss runs under `loss_parallel()` (set as
  `model._meshforge_loss_context`), so the full-vocabulary logits are never gathered.
- `replicate`: the module is left out of tensor parallelism (weights whole on every TP rank). With sequence
  parallelism a replicated vocabulary layer gets its input gathered / output re-sharded along the sequence;
  a replicated sequence-parallel norm is rejected (its weight gradient would miss the other ranks' tokens).
  In the config, `colwise` on the module the model declares `vocab_output` keeps the vocabulary-parallel
  loss, and `rowwise` on its `vocab_embedding` keeps the vocabulary-sharded embedding.

Validation (`plan_problems`, also run by `config/rules.py` on a meta-device model before anything starts): a
pattern that names no module, a style on a module it cannot shard (not Linear/Embedding), or a sharded
dimension that does not divide by tp_size is reported with the module name and its shape, instead of an
opaque DTensor assertion in the first step.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

SHARDED_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_output")
ALL_STYLES = SHARDED_STYLES + ("sequence_parallel", "sequence_gather", "replicate")


# ------------------------------------------------------------------------------ plan resolution
def pattern_matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n, p))


def _expand(modules: dict[str, nn.Module], plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """pattern plan -> {module name: style}, in module order; and the patterns that matched nothing."""
    names = [n for n in modules if n]
    out: dict[str, str] = {}
    unmatched = []
    for pattern, style in plan.items():
        hits = [n for n in names if pattern_matches(pattern, n)]
        if not hits:
            unmatched.append(pattern)
        for n in hits:
            out[n] = style
    return out, unmatched


def resolve_plan(model: nn.Module, sequence_parallel: bool, custom: dict[str, str] | None,
                 modules: dict[str, nn.Module] | None = None) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(resolved {module: style}, declared {module: style}, problems) for `model` (or its `modules` by name)."""
    modules = modules if modules is not None else dict(model.named_modules())
    problems: list[str] = []
    declared: dict[str, str] = {}
    if hasattr(model, "tp_plan"):
        declared, _ = _expand(modules, model.tp_plan(sequence_parallel))
    elif not custom:
        problems.append(f"distributed.tp_size > 1 but the model ({type(model).__name__}) declares no tp_plan: "
                        "set distributed.tp_plan (module pattern -> colwise/rowwise/sequence_parallel/replicate)")
    resolved = dict(declared)
    if custom:
        overrides, unmatched = _expand(modules, custom)
        for pattern in unmatched:
            problems.append(f"distributed.tp_plan pattern {pattern!r} names no module of the model: patterns match "
                            f"dotted module names per component, e.g. 'layers.*.attention.wq'")
        for name, style in overrides.items():
            base = declared.get(name)
            if (style, base) in (("colwise", "vocab_output"), ("rowwise", "vocab_embedding")):
                style = base
            resolved[name] = style
    return resolved, declared, problems


def _shape(module: nn.Module) -> tuple[int, ...] | None:
    w = getattr(module, "weight", None)
    return tuple(w.shape) if isinstance(w, torch.Tensor) else None


def plan_problems(model: nn.Module, tp_size: int, sequence_parallel: bool, custom: dict[str, str] | None,
                  modules: dict[str, nn.Module] | None = None) -> list[str]:
    """Every reason this plan cannot be applied at tp_size, naming the module and its shape."""
    modules = modules if modules is not None else dict(model.named_modules())
    resolved, declared, problems = resolve_plan(model, sequence_parallel, custom, modules)
    for name, style in resolved.items():
        mod = modules[name]
        shape = _shape(mod)
        if style == "replicate":
            if sequence_parallel and declared.get(name) == "sequence_parallel":
                problems.append(f"distributed.tp_plan: module {name!r} must stay sequence_parallel with "
                                "sequence_parallel=true (a replicated norm would miss other ranks' gradients): "
                                "remove the entry or set sequence_parallel false")
            continue
        if style not in SHARDED_STYLES:
            continue
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            problems.append(f"tensor-parallel style {style!r} on module {name!r} ({type(mod).__name__}): only "
                            "nn.Linear and nn.Embedding can be sharded; point the pattern at the projections")
            continue
        dim = _sharded_dim(mod, style)  # Linear weights are (out, in), Embedding weights (num, dim)
        if shape[dim] % tp_size:
            problems.append(f"tensor parallelism: module {name!r} with weight shape {list(shape)} cannot be "
                            f"split {style} over distributed.tp_size={tp_size} (dimension {dim} = {shape[dim]} "
                            f"is not divisible): choose a tp_size dividing {shape[dim]} or mark it 'replicate'")
    for names in _tied_parameters(model):
        dims = {}
        for pname in names:
            mod_name = pname.rpartition(".")[0]
            dims[mod_name] = _sharded_dim(modules[mod_name], resolved.get(mod_name, "replicate"))
        if len(set(dims.values())) > 1:
            desc = ", ".join(f"{m!r} {'whole' if d is None else f'split on dim {d}'}" for m, d in dims.items())
            problems.append(f"tensor parallelism: tied weight {names[0]!r} is used by modules sharded differently "
                            f"({desc}): give them matching styles in distributed.tp_plan or set "
                            "model.tie_embeddings false")
    return _fold_layers(problems)


def _sharded_dim(mod: nn.Module, style: str) -> int | None:
    """Which weight dimension a style splits (None: kept whole)."""
    if style not in SHARDED_STYLES:
        return None
    emb = isinstance(mod, nn.Embedding)
    if style in ("colwise", "vocab_output"):
        return 1 if emb else 0
    return 0 if emb else 1


def _fold_layers(problems: list[str]) -> list[str]:
    """The same problem in many layers is one line: 'layers.*.x' (in N layers)."""
    import re

    groups: dict[str, list[str]] = {}
    for msg in problems:
        groups.setdefault(re.sub(r"'layers\.\d+\.", "'layers.*.", msg), []).append(msg)
    return [msgs[0] if len(msgs) == 1 else f"{key} (in {len(msgs)} layers)" for key, msgs in groups.items()]


def config_plan_problems(model_cfg, tp_size: int, sequence_parallel: bool, custom: dict[str, str] | None
                         ) -> list[str]:
    """`plan_problems` for a built-in model described by a config, without processes or memory.

    One block is built on the meta device and its modules stand in for every layer's (all blocks of a
    built-in model have the same shapes), so a 70B model validates in milliseconds.
    """
    from meshforge.models import build_model, resolve_model_args

    n_layers = resolve_model_args(model_cfg).n_layers
    model = build_model(model_cfg.model_copy(update={"n_layers": 1}), device="meta")
    modules = {}
    for name, mod in model.named_modules():
        if name == "layers.0" or name.startswith("layers.0."):
            for i in range(n_layers):
                modules["layers." + str(i) + name[len("layers.0"):]] = mod
        else:
            modules[name] = mod
    return plan_problems(model, tp_size, sequence_parallel, custom, modules)


# ------------------------------------------------------------------------------ styles
def _styles(sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sequence_parallel else Replicate()
    SequenceGather, _ = _style_classes()
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=seq),
        "sequence_parallel": SequenceParallel(),
        "sequence_gather": SequenceGather(),
        "vocab_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "vocab_output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }


def _style_classes():
    """meshforge's two small styles (built lazily: this module's plan checks run without torch.distributed)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def to_full(x, mesh):
        """A sequence-sharded activation (DTensor, or plain local shard) -> the full plain tensor."""
        if isinstance(x, DTensor):
            return x.redistribute(mesh, [Replicate()]).to_local()
        if isinstance(x, torch.Tensor):
            return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(
                mesh, [Replicate()]).to_local()
        return x

    class SequenceGather(ParallelStyle):
        """All-gather the first positional input along the sequence (Shard(1) -> Replicate), as a plain tensor."""

        def _apply(self, module, mesh):
            module.register_forward_pre_hook(lambda m, args: (to_full(args[0], mesh),) + tuple(args[1:]))
            return module

    class ReplicateSP(ParallelStyle):
        """A replicated module inside a sequence-parallel model: full input in; optionally re-shard the output."""

        def __init__(self, gather_input: bool, shard_output: bool):
            super().__init__()
            self.gather_input, self.shard_output = gather_input, shard_output

        def _apply(self, module, mesh):
            if self.gather_input:
                module.register_forward_pre_hook(lambda m, args: (to_full(args[0], mesh),) + tuple(args[1:]))
            if self.shard_output:
                def shard(m, args, out):
                    return DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(
                        mesh, [Shard(1)]).to_local()

                module.register_forward_hook(shard)
            return module

    return SequenceGather, ReplicateSP


# ------------------------------------------------------------------------------ apply
def apply_tp(model: nn.Module, mesh_ctx, dcfg) -> nn.Module:
    """Shard `model` in place over the `tp` mesh; raises ConfigError (before any step) for a bad plan."""
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tp, sp = mesh_ctx.tp_size, bool(dcfg.sequence_parallel)
    problems = plan_problems(model, tp, sp, dcfg.tp_plan)
    if problems:
        from meshforge.config import ConfigError

        raise ConfigError(problems)
    resolved, declared, _ = resolve_plan(model, sp, dcfg.tp_plan)
    mesh = mesh_ctx.mesh("tp")
    styles = _styles(sp)
    _, ReplicateSP = _style_classes()
    plan: dict[str, Any] = {}
    for name, style in resolved.items():
        if style == "replicate":
            base = declared.get(name)
            if sp and base in ("vocab_embedding", "vocab_output"):
                plan[name] = ReplicateSP(gather_input=base == "vocab_output", shard_output=base == "vocab_embedding")
            continue
        plan[name] = styles[style]
    ties = _tied_parameters(model)
    if plan:
        parallelize_module(model, mesh, plan)
    _retie(model, ties)
    if "vocab_output" in resolved.values():
        model._meshforge_loss_context = loss_parallel
    return model


def _tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. tied embedding and output)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """parallelize_module distributes each module's weight separately, which would silently untie shared
    weights: point every name of a group back at the first one's (now distributed) parameter."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                from meshforge.config import ConfigError

                msg = (f"tied parameters {names[0]!r} and {name!r} get different tensor-parallel placements "
                       f"({getattr(first, 'placements', 'whole')} vs {getattr(other, 'placements', 'whole')}): "
                       "give both modules matching styles in distributed.tp_plan or untie them")
                raise ConfigError([msg])
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
