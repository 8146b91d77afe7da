"""Tensor-parallel plans resolved and checked without processes: which module gets which style, and why a
plan cannot be applied at a tp size.

The plan is a dict of module-name patterns -> style. Patterns match module names component by component
(`*` is one name component, fnmatch inside a component). The model declares its plan (the model contract's
`tp_plan(sequence_parallel)`); `distributed.tp_plan` from the config is laid over it, module by module (a
config entry wins). A model that declares no plan uses the config plan alone. In the config, `colwise` on the
module the model declares `vocab_output` keeps the vocabulary-parallel loss, and `rowwise` on its
`vocab_embedding` keeps the vocabulary-sharded embedding. `distributed/tensor_parallel.py` applies the
resolved plan with DTensor.

`plan_problems` reports a pattern that names no module, a style on a module it cannot shard (not
Linear/Embedding), a sharded dimension that does not divide by tp_size, and tied weights split differently,
each with the module name and its shape. `config/rules.py` runs it on the model's description
(`models.plan_modules`: torch-free for the built-in models) before anything starts, so a bad plan fails in
validation, not as an opaque DTensor assertion in the first step. How the model uses the sharded tensors (a
parameter the plan leaves whole meeting sharded activations) is checked by running it (`planning/tp_trace.py`):
in validation for a `model.hf_model` small enough to hold in memory (`models.probe_model`), and always
in the trainer before the first collective.
"""

from __future__ import annotations

from typing import Any

from meshforge.models import plan_modules
from meshforge.models.shapes import ModuleShape, model_contract, pattern_matches
from meshforge.planning.tp_trace import fold_repeats, trace_plan

SHARDED_STYLES = ("colwise", "rowwise", "rowwise_full", "vocab_embedding", "vocab_output", "local_heads",
                  "colwise_gather", "rowwise_split")
# `local_heads`: a module's per-head parameters split on dim 0 with the heads (GPT-OSS's attention sinks; Cohere's
# q/k norms, found by planning/tp_trace.py); `head_norm`: a per-head norm (QK-norm) kept whole, applied to this
# rank's heads, its gradient summed over tp; `sequence_parallel_residual`: a norm whose output joins the residual
# stream (Gemma's post-norms), sequence-sharded like `sequence_parallel`; `shared_input`: an input every rank's
# heads share (DeepSeek's rope key), its gradient summed over tp; `rowwise_full` / `sequence_gather_scatter`: an
# MoE under sequence parallelism (distributed/tensor_parallel.py); `colwise_gather` / `rowwise_split`: transformers'
# colwise_gather_output / rowwise_split_input (split inside the module, whole outside); `replicate_grad_sum`:
# transformers' replicated_with_grad_allreduce (whole parameters used on this rank's heads, gradient summed over tp)
ALL_STYLES = SHARDED_STYLES + ("sequence_parallel", "sequence_parallel_residual", "sequence_gather",
                               "sequence_gather_scatter", "head_norm", "shared_input", "replicate",
                               "replicate_grad_sum")
# whole on every tp rank, gradients arrive Partial (summed over tp when the gradient norm and the step read them);
# `replicate_grad_sum` is not one: its plain gradient is summed in backward, at every micro batch
PARTIAL_GRAD_STYLES = ("sequence_parallel", "sequence_parallel_residual", "head_norm")


def _kind(mod: Any) -> str | None:
    """What TP can shard: "linear" (nn.Linear or a subclass), "embedding" (nn.Embedding or a subclass), or their
    torch-free descriptions; else None. Decided without importing torch."""
    if isinstance(mod, ModuleShape):
        return {"Linear": "linear", "Embedding": "embedding"}.get(mod.kind)
    for c in type(mod).__mro__:
        if c.__module__ == "torch.nn.modules.linear" and c.__name__ == "Linear":
            return "linear"
        if c.__module__ == "torch.nn.modules.sparse" and c.__name__ == "Embedding":
            return "embedding"
    return None


def _type_name(mod: Any) -> str:
    return mod.kind if isinstance(mod, ModuleShape) else type(mod).__name__


def _expand(modules: dict[str, Any], plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
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


def resolve_plan(model: Any, sequence_parallel: bool, custom: dict[str, str] | None,
                 modules: dict[str, Any] | None = None) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(resolved {module: style}, declared {module: style}, problems) for `model` (or its `modules` by name)."""
    modules = modules if modules is not None else dict(model.named_modules())
    problems: list[str] = []
    declared_plan = model_contract(model).tp_plan(sequence_parallel)
    declared: dict[str, str] = {}
    if declared_plan is not None:
        declared, _ = _expand(modules, declared_plan)
    elif not custom:
        problems.append(f"distributed.tp_size > 1 but the model ({_type_name(model)}) declares no tp_plan: "
                        "set distributed.tp_plan (module pattern -> colwise/rowwise/sequence_parallel/replicate)")
    resolved = dict(declared)
    if custom:
        overrides, unmatched = _expand(modules, custom)
        plan = declared_plan or {}
        example = next((p for p in plan if "*" in p), next(iter(plan), "blocks.*.proj"))
        for pattern in unmatched:
            problems.append(f"distributed.tp_plan pattern {pattern!r} names no module of the model: patterns match "
                            f"dotted module names per component, e.g. {example!r}")
        for name, style in overrides.items():
            base = declared.get(name)
            if (style, base) in (("colwise", "vocab_output"), ("rowwise", "vocab_embedding")):
                style = base
            resolved[name] = style
    return resolved, declared, problems


def _shape(module: Any) -> tuple[int, ...] | None:
    w = getattr(module, "weight", None)
    return tuple(w.shape) if w is not None else None


def sharded_dim(mod: Any, style: str) -> int | None:
    """Which weight dimension a style splits (None: kept whole). Linear weights are (out, in), Embedding
    weights (num, dim)."""
    if style not in SHARDED_STYLES:
        return None
    if style == "local_heads":
        return 0
    emb = _kind(mod) == "embedding"
    if style in ("colwise", "vocab_output", "colwise_gather"):
        return 1 if emb else 0
    return 0 if emb else 1


def tied_parameters(model: Any) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. a tied embedding and output head)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def plan_problems(model: Any, tp_size: int, sequence_parallel: bool, custom: dict[str, str] | None,
                  modules: dict[str, Any] | None = None) -> list[str]:
    """Every reason this plan cannot be applied at tp_size, naming the module and its shape."""
    modules = modules if modules is not None else dict(model.named_modules())
    resolved, declared, problems = resolve_plan(model, sequence_parallel, custom, modules)
    for name, style in resolved.items():
        mod = modules[name]
        if style == "replicate":
            if sequence_parallel and declared.get(name) in ("sequence_parallel", "sequence_parallel_residual"):
                problems.append(f"distributed.tp_plan: module {name!r} must stay sequence_parallel with "
                                "sequence_parallel=true (a replicated norm would miss other ranks' gradients): "
                                "remove the entry or set sequence_parallel false")
            continue
        if style not in SHARDED_STYLES:
            continue
        if _kind(mod) is None and style != "local_heads":
            problems.append(f"tensor-parallel style {style!r} on module {name!r} ({_type_name(mod)}): only "
                            "nn.Linear and nn.Embedding can be sharded; point the pattern at the projections")
            continue
        shape, dim = _shape(mod), sharded_dim(mod, style)
        if shape[dim] % tp_size:
            problems.append(f"tensor parallelism: module {name!r} with weight shape {list(shape)} cannot be "
                            f"split {style} over distributed.tp_size={tp_size} (dimension {dim} = {shape[dim]} "
                            f"is not divisible): choose a tp_size dividing {shape[dim]} or mark it 'replicate'")
    for names in tied_parameters(model):
        dims = {}
        for pname in names:
            mod_name = pname.rpartition(".")[0]
            dims[mod_name] = sharded_dim(modules[mod_name], resolved.get(mod_name, "replicate"))
        if len(set(dims.values())) > 1:
            desc = ", ".join(f"{m!r} {'whole' if d is None else f'split on dim {d}'}" for m, d in dims.items())
            problems.append(f"tensor parallelism: tied weight {names[0]!r} is used by modules sharded differently "
                            f"({desc}): give them matching styles in distributed.tp_plan or set "
                            "model.tie_embeddings false")
    return fold_repeats(problems)


def config_plan_problems(model_cfg, tp_size: int, sequence_parallel: bool, custom: dict[str, str] | None
                         ) -> list[str]:
    """`plan_problems` for a built-in model described by a config, on its meta-device description (memoised:
    `meshforge plan --fit` checks the same model at the same few tp sizes for many candidates)."""
    key = (type(model_cfg).__name__, model_cfg.model_dump_json(), tp_size, sequence_parallel,
           tuple(custom.items()) if custom else None)
    if key not in _PLAN_PROBLEMS:
        if len(_PLAN_PROBLEMS) > 256:
            _PLAN_PROBLEMS.clear()
        model, modules = plan_modules(model_cfg)
        problems = plan_problems(model, tp_size, sequence_parallel, custom, modules)
        if not problems:
            problems = _traced_problems(model_cfg, model, tp_size, sequence_parallel, custom)
        _PLAN_PROBLEMS[key] = tuple(problems)
    return list(_PLAN_PROBLEMS[key])


_PLAN_PROBLEMS: dict = {}


def _traced_problems(model_cfg, meta_model, tp_size: int, sequence_parallel: bool, custom) -> list[str]:
    """`planning/tp_trace.py` on a `model.hf_model` validation holds in CPU memory (`models.probe_model`:
    its forward decides on values, so not on the meta device); larger ones, and the built-in models (whose declared
    plans cover every parameter), are traced by the trainer before the first collective
    (`distributed/tensor_parallel.py`)."""
    from meshforge.models import probe_model, resolve_model_args

    args = resolve_model_args(model_cfg)
    if not args.hf_model:
        return []
    model = probe_model(args)
    if any(p.is_meta for p in model.parameters()):
        return []
    resolved, _, _ = resolve_plan(model, sequence_parallel, custom)
    return trace_plan(model, resolved, tp_size)[1]
