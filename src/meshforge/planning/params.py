"""The model as the planner sees it: one record per parameter (shape, block, TP split, expert, place, trainable),
read from the model's torch-free description (`models.plan_modules`; the meta-device model for hf_model; one block
stands in for every block), LoRA applied as the run applies it. Also the per-shard arithmetic every strategy's
terms share and the memo the layout search leans on (it plans hundreds of candidates over one parameter list).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshforge.planning.layout import Layout

F32 = 4
STEP_BYTES = 4  # AdamW's per-tensor `step` (a float32 scalar)


@dataclass(frozen=True)
class ParamRec:
    name: str
    shape: tuple[int, ...]
    block: int | None  # block index, None for the rest of the model
    tp_dim: int | None  # dimension split over tp, None when whole
    expert: bool  # stacked routed-expert weights (dim 0 = expert)
    place: str  # "block", "first" (first pipeline stage), "last" or "other"
    trainable: bool = True  # False: frozen (LoRA's base weights): no gradient, no optimizer state
    # replicated over tp while its gradient arrives Partial: the norms under sequence parallelism (their input is
    # sequence-sharded) and the LoRA factor kept whole beside a split base layer
    partial_grad: bool = False
    adapter: bool = False  # a LoRA factor (`models.lora.is_adapter_param`), decided once: the search asks often
    # a first-stage weight a last-stage module also uses (a tied output head), by that module's name: under pipeline
    # parallelism the last stage holds a copy under this name (distributed/pipeline_ties.py)
    tied_copy: str | None = None
    copy: bool = False  # such a copy itself (`planning.state.tied_copy`): its gradient norm is its original's
    # sequence parallelism: the sub-layer module that gathers the sequence for it (style sequence_gather[_scatter])
    seq_sub: str | None = None
    whole_out: bool = False  # a row-wise projection whose output is all-reduced whole (style rowwise_full)
    tp_style: str | None = None  # its module's TP style (the collectives of transformers' styles are per module)


def model_params(cfg) -> tuple[list[ParamRec], object]:
    """Every parameter of the configured built-in model (tied weights once), from its meta description."""
    from meshforge.models import plan_layout, plan_modules, resolve_model_args
    from meshforge.models.shapes import ADAPTER_PARTS, is_adapter_param
    from meshforge.models.shapes import model_contract
    from meshforge.planning.tp_plan import PARTIAL_GRAD_STYLES, resolve_plan, sharded_dim

    args = resolve_model_args(cfg.model)
    one, modules = plan_modules(cfg.model)  # torch-free for the built-in models (models/shapes.py)
    if cfg.peft is not None:
        one, modules = _with_lora(one, modules, cfg.peft)
    contract = model_contract(one)
    layout = plan_layout(one, cfg.distributed.block_classes)
    block_of = _block_index(layout)
    d = cfg.distributed
    styles = {}
    if d.tp_size > 1:
        styles, _, _ = resolve_plan(one, d.sequence_parallel, d.tp_plan, modules)
    # the stacked expert weights and their per-expert LoRA factors (dim 0 = expert: they shard with EP)
    expert_ids = {id(p) for layer in contract.moe_layers() for p in layer.experts.parameters()}
    out, seen = [], {}
    for mname, mod in modules.items():
        block = block_of(mname)
        for pname, p in mod.named_parameters(recurse=False):
            key = (id(p), block)
            if key in seen:
                i = seen[key]
                if block is None and _place(mname, layout) == "last" and out[i].place == "first":
                    out[i] = dataclasses.replace(out[i], tied_copy=f"{mname}.{pname}")
                continue
            seen[key] = len(out)
            place = "block" if block is not None else _place(mname, layout)
            style = styles.get(mname)
            tp_dim = sharded_dim(mod, style) if style else None
            if tp_dim is not None and tp_dim >= len(p.shape):  # a row-wise projection's bias stays whole
                tp_dim = None
            partial = style in PARTIAL_GRAD_STYLES
            parent, _, part = mname.rpartition(".")
            if part in ADAPTER_PARTS and styles.get(parent):
                # LoRA factors follow their base layer's style (distributed/tensor_parallel.py): under colwise B is
                # split by rows and A whole; under rowwise A is split by columns and B whole
                # (colwise_gather / rowwise_split / rowwise_full: as colwise / rowwise)
                base = styles[parent].split("_")[0]
                tp_dim = {("colwise", "lora_B"): 0, ("rowwise", "lora_A"): 1}.get((base, part))
                partial = tp_dim is None
            full = f"{mname}.{pname}" if mname else pname
            out.append(ParamRec(full, tuple(p.shape), block, tp_dim, id(p) in expert_ids, place, p.requires_grad,
                                partial, is_adapter_param(full), seq_sub=_gathering(mname, styles),
                                whole_out=style == "rowwise_full", tp_style=style))
    return out, args


def _block_index(layout):
    """module name -> index of the block it is in (None outside the blocks): the innermost split point at or above
    it (a model.hf_model's blocks, each named), else, for a built-in model's stand-in blocks (`plan_modules`: the
    whole model's blocks under the names of one container), the index after that container's name."""
    if not layout or not layout.split_points:
        return lambda mname: None
    points = {name: i for i, name in enumerate(layout.split_points)}
    container = layout.split_points[0].rpartition(".")[0]

    def block_of(mname: str) -> int | None:
        name = mname
        while name:
            if name in points:
                return points[name]
            name = name.rpartition(".")[0]
        if container and mname.startswith(container + "."):
            return int(mname[len(container) + 1:].split(".")[0])
        return None

    return block_of


def _gathering(mname: str, styles: dict[str, str]) -> str | None:
    """The nearest module at or above `mname` that gathers the sequence (sequence parallelism), or None."""
    name = mname
    while name:
        if styles.get(name) in ("sequence_gather", "sequence_gather_scatter"):
            return name
        name = name.rpartition(".")[0]
    return None


def _place(mname: str, layout) -> str:
    """The pipeline place of a module outside the blocks: "first", "last" or "other"."""
    name = mname
    while layout is not None and name:
        if name in layout.first_stage or name in layout.last_stage:
            return "first" if name in layout.first_stage else "last"
        name = name.rpartition(".")[0]
    return "other"


def _with_lora(one, modules: dict, peft):
    """The one-block meta model with LoRA applied (adapters on the targeted linears, the freeze policy) and
    the whole model's {name: module} rebuilt from it, each block's modules standing in for every block's."""
    from meshforge.models.shapes import ModelShape
    from meshforge.models.shapes import apply_lora as apply_to_description

    if isinstance(one, ModelShape):
        apply_lora = apply_to_description  # the same adapters and freeze policy, without torch
    else:  # a torch model (model.hf_model's, cached for validation and every plan): adapted as a copy, never itself
        import copy

        from meshforge.models.lora import apply_lora

        memo: dict = {}
        one = copy.deepcopy(one, memo)
        modules = {n: memo[id(m)] for n, m in modules.items()}

    names: dict[int, list[str]] = {}  # each module object -> every name it stands under
    for n, m in modules.items():
        names.setdefault(id(m), []).append(n)
    before = dict(one.named_modules())
    apply_lora(one, peft)
    out = {}
    for name, mod in one.named_modules():
        old = before.get(name)
        if old is not None:
            for whole in names[id(old)]:
                out[whole] = mod
        else:  # a new adapter module (at any depth) under its nearest original ancestor: under each of that
            # ancestor's whole-model names (expert adapters sit two levels down: `experts.adapters.<role>`)
            parent, child = name, ""
            while parent and parent not in before:
                parent, _, last = parent.rpartition(".")
                child = f"{last}.{child}" if child else last
            for whole in names[id(before[parent])] if parent in before else []:
                out[f"{whole}.{child}" if whole else child] = mod
    return one, out


def chunk_rows(dim0: int, world: int, rank: int) -> int:
    """Rows of `torch.chunk(dim0 rows, world)`'s piece `rank` (the last pieces may be short or empty)."""
    size = -(-dim0 // world) if dim0 else 0
    start = min(rank * size, dim0)
    return min(start + size, dim0) - start


def local_shape(p: ParamRec, layout: Layout) -> list[int]:
    """The shape of `p` on one rank before data-parallel sharding: split over tp, experts over ep."""
    s = list(p.shape)
    if p.tp_dim is not None:
        s[p.tp_dim] //= layout.tp
    if p.expert and layout.ep > 1:
        s[0] //= layout.ep
    return s


def replicate_grad(p: ParamRec) -> bool:
    """Without FSDP the vocabulary-parallel embedding's gradient arrives Replicate (each tp rank holds the whole
    vocab x dim gradient, measured with torch 2.13), except for a weight tied to the output head: without PP the
    head's sharded gradient is what accumulates; across pipeline stages the gradient is placed as the weight to be
    summed with the last stage's copy (distributed/pipeline_ties.py)."""
    return p.tp_dim is not None and p.place == "first" and not p.tied_copy


def local_numel(p: ParamRec, layout: Layout) -> int:
    return math.prod(local_shape(p, layout))


_STAGE_CACHE: dict = {}


def memo(kind: str, obj, key: tuple, compute):
    """`compute()` memoised per (kind, the list `obj`, key): the search plans hundreds of candidates over the
    same parameter lists. The entry holds `obj`, so its id is not reused while cached."""
    hit = _STAGE_CACHE.get((kind, id(obj), key))
    if hit is not None and hit[0] is obj:
        return hit[1]
    if len(_STAGE_CACHE) > 8192:
        _STAGE_CACHE.clear()
    value = compute()
    _STAGE_CACHE[(kind, id(obj), key)] = (obj, value)
    return value


def alike(stage: list[ParamRec]) -> list[tuple[ParamRec, int]]:
    """[(a parameter, how many of the stage's parameters are stored like it)]: those equal in shape, split,
    expert-ness, trainability and being the first stage's (memoised per stage list)."""
    def compute():
        kinds: dict = {}
        for p in stage:
            k = (p.shape, p.tp_dim, p.expert, p.trainable, p.place == "first", bool(p.tied_copy))
            rep, n = kinds.get(k, (p, 0))
            kinds[k] = (rep, n + 1)
        return list(kinds.values())

    return memo("alike", stage, (), compute)


def blocks_alike(params: list[ParamRec]) -> list[tuple[int | None, tuple, list[tuple[ParamRec, int]]]]:
    """[(block, its signature, [(a parameter, how many of the block's parameters are stored like it)])] for each
    block of `params` in order (None: those outside the blocks), blocks of equal signature having equal
    parameters (shape, split, expert-ness, trainability): a sum per block is computed once per signature
    (memoised per list: the blocks of a deep model are alike, and the search asks for every candidate)."""
    def compute():
        by_block: dict = {}
        for p in params:
            kinds = by_block.setdefault(p.block, {})
            k = (p.shape, p.tp_dim, p.expert, p.trainable)
            rep, n = kinds.get(k, (p, 0))
            kinds[k] = (rep, n + 1)
        return [(b, tuple((k, n) for k, (_, n) in kinds.items()), list(kinds.values()))
                for b, kinds in by_block.items()]

    return memo("blocks_alike", params, (), compute)


def n_params(params: list[ParamRec]) -> int:
    return memo("n", params, (), lambda: sum(math.prod(p.shape) for p in params))
