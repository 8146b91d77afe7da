"""Tensor and sequence parallelism: apply a model's resolved TP plan (`planning/tp_plan.py`) with DTensor.

`apply_tp(model, mesh_ctx, dcfg)` runs before context parallelism and before any data-parallel strategy, and
returns the loss context the step must run the loss in: `loss_parallel()` for a vocabulary-sharded head's logits,
and the fused loss's tensor-parallel form (`vocab_parallel_loss.tp_head_loss`) for a `HeadInput`.

Styles (torch's `parallelize_module` styles, placed the way torchtitan places them):
- `colwise`: `ColwiseParallel`, weight rows sharded, output a local shard of the features (heads).
- `rowwise`: `RowwiseParallel`, weight columns sharded, output all-reduced (reduce-scattered along the
  sequence, `Shard(1)`, with sequence parallelism).
- `sequence_parallel`: `SequenceParallel` (norms): activations sharded along the sequence on the TP group.
- `sequence_parallel_residual`: the same for a norm whose output is added to the residual stream (Gemma 3's
  post-norms): its output is the plain local sequence shard, as the residual stream is.
- `sequence_gather` (model plans only, with sequence parallelism): the module's first input arrives sequence
  sharded and is all-gathered once for all the column-wise projections inside (attention, MLP).
- `sequence_gather_scatter` (with sequence parallelism): the module's first input is gathered as by
  `sequence_gather`, and its output is split back to this rank's sequence shard, whose backward all-gathers the
  gradient. For a module every tp rank computes whole (an MoE's router and routed experts, which TP does not split):
  each rank then backpropagates the whole sequence, so the replicated weights get identical gradients everywhere.
- `rowwise_full`: `RowwiseParallel` whose output is all-reduced to the whole sequence even with sequence
  parallelism (the shared experts inside a `sequence_gather_scatter` MoE, added to its whole routed output).
- `vocab_embedding`: `RowwiseParallel` on the embedding, vocabulary sharded.
- `vocab_output`: `ColwiseParallel` on the output projection with `use_local_output=False`: the logits stay a
  vocabulary-sharded DTensor and the loss runs under `loss_parallel()` (the returned loss context), so the
  full-vocabulary logits are never gathered. With the fused loss the head's forward does not run: the loss
  projects chunk by chunk on each rank's vocabulary rows (`vocab_parallel_loss.py`).
- `local_heads`: the module's per-head parameters split on dim 0 with the heads, its forward on the local shards:
  declared by a model (GPT-OSS's attention sinks, `weight` (heads,)) or found by `planning/tp_trace.py` (Cohere's
  q/k norms, weight (heads, head_dim)).
- `head_norm`: a per-head norm (QK-norm) on (B, S, local heads, head_dim): `SequenceParallel` over the heads
  dimension, so the weight is a replicated DTensor whose gradient (from this rank's heads) is summed over tp.
- `shared_input` (model plans only): the module's first input is one tensor every TP rank uses for its own heads
  only (DeepSeek's rope key, shared by all query heads): identity forward, its gradient (each rank's heads' share)
  summed over the TP group in backward, as a column-wise layer sums its input's gradient.
- `colwise_gather` / `rowwise_split` (transformers' `colwise_gather_output` / `rowwise_split_input`, e.g. GLM's
  fused gate_up_proj, whose output is chunked in features, then down_proj): `ColwiseParallel` with the output
  all-gathered whole; `RowwiseParallel` taking a whole input and splitting it itself.
- `replicate_grad_sum` (transformers' `replicated_with_grad_allreduce`, e.g. a (head_dim,) q/k norm applied on each
  rank's own heads): parameters whole on every rank, their gradient summed over the TP group in backward
  (`planning/tp_trace.py` checks that they do meet sharded activations: else the sum would count tp times).
- `replicate`: the module is left out of tensor parallelism (weights whole on every TP rank). With sequence
  parallelism a replicated vocabulary layer gets its input gathered / output re-sharded along the sequence.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from meshforge.distributed.float8 import float8_tp_styles
from meshforge.distributed.vocab_parallel_loss import tp_head_loss
from meshforge.errors import ConfigError
from meshforge.models.lora import LoRALinear
from meshforge.models.loss import head_loss_override
from meshforge.planning.tp_plan import plan_problems, resolve_plan, tied_parameters
from meshforge.planning.tp_trace import trace_plan


# ------------------------------------------------------------------------------ styles
def _to_full(x, mesh):
    """A sequence-sharded activation (DTensor, or plain local shard) -> the full plain tensor."""
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local()
    if isinstance(x, torch.Tensor):
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    return x


class SequenceGather(ParallelStyle):
    """All-gather the first positional input along the sequence (Shard(1) -> Replicate), as a plain tensor.

    `save_shard` (blocks that are not checkpointed, eager): what the projections inside keep of the gathered
    input for backward is the sequence shard it came from, gathered again at the first use in backward, as
    Megatron's sequence parallelism does. Autograd would otherwise keep the full sequence for each sub-layer,
    tp times the shard: at TP 8 and Llama 3 405B's width 57 KB of the 144 KB a token and layer kept.
    Checkpointed blocks already recompute the gather in backward; under torch.compile the gather's output is
    kept (saved-tensor hooks break the compiled graph)."""

    def __init__(self, save_shard: bool = False):
        super().__init__()
        self.save_shard = save_shard

    def _apply(self, module, mesh):
        if not self.save_shard:
            module.register_forward_pre_hook(lambda m, args: (_to_full(args[0], mesh),) + tuple(args[1:]))
            return module
        inner = module.forward

        @functools.wraps(inner)
        def forward(x, *args, **kwargs):
            full = _to_full(x, mesh)
            if not torch.is_grad_enabled() or torch.compiler.is_compiling():
                return inner(full, *args, **kwargs)
            with _ShardSaved(x.to_local() if isinstance(x, DTensor) else x, full, mesh).hooks():
                return inner(full, *args, **kwargs)

        module.forward = forward
        return module


class _ShardSaved:
    """Saved-tensor hooks for one gathered activation: a saved tensor that is (a view of) the gathered `full`
    is kept as the local `shard` (once, however many projections keep it), and the first unpack in backward
    gathers it again for all of them. Every other saved tensor, and the shard itself, goes through the hooks
    already active (a measurement, an outer checkpoint), so those see what is really kept."""

    def __init__(self, shard: torch.Tensor, full: torch.Tensor, mesh):
        # the storage itself, not its address: fake tensors (the scale trace) all have address 0
        self.mesh, self.full_storage = mesh, _storage_id(full)
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.shard, self.packed_shard, self.regathered = shard, None, None

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if _storage_id(local) != self.full_storage:
            return self.outer[0](t) if self.outer else t
        if self.packed_shard is None:
            self.packed_shard = self.outer[0](self.shard) if self.outer else self.shard
            self.shard = None
        return _GatheredView(local.size(), local.stride(), local.storage_offset(),
                             t._spec if isinstance(t, DTensor) else None)

    def unpack(self, packed):
        if not isinstance(packed, _GatheredView):
            return self.outer[1](packed) if self.outer else packed
        if self.regathered is None:
            shard = self.outer[1](self.packed_shard) if self.outer else self.packed_shard
            full = _to_full(shard, self.mesh)
            self.regathered = full.wait() if isinstance(full, AsyncCollectiveTensor) else full
        view = self.regathered.as_strided(packed.size, packed.stride, packed.offset)
        return view if packed.spec is None else DTensor(view, packed.spec, requires_grad=False)


def _storage_id(t: torch.Tensor) -> int | None:
    """The tensor's storage itself, not its address (fake tensors, the scale trace's, all have address 0); None for
    a wrapper subclass without storage (float8's casts)."""
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:
        return None


@dataclass(frozen=True)
class _GatheredView:
    """Where a saved tensor sits in the gathered input (its hooks' owner gathers that input again)."""
    size: torch.Size
    stride: tuple
    offset: int
    spec: Any


def _to_shard(out: torch.Tensor, mesh) -> torch.Tensor:
    """A whole-sequence output every tp rank holds alike -> this rank's sequence shard (backward: all-gather)."""
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


class SequenceGatherScatter(SequenceGather):
    """`SequenceGather` on the input, and the output split back to the sequence shard (see the module docstring)."""

    def _apply(self, module, mesh):
        module = super()._apply(module, mesh)
        module.register_forward_hook(lambda m, args, out: _to_shard(out, mesh))
        return module


class ReplicateSP(ParallelStyle):
    """A replicated module inside a sequence-parallel model: full input in; optionally re-shard the output."""

    def __init__(self, gather_input: bool, shard_output: bool):
        super().__init__()
        self.gather_input, self.shard_output = gather_input, shard_output

    def _apply(self, module, mesh):
        if self.gather_input:
            module.register_forward_pre_hook(lambda m, args: (_to_full(args[0], mesh),) + tuple(args[1:]))
        if self.shard_output:
            module.register_forward_hook(lambda m, args, out: _to_shard(out, mesh))
        return module


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient all-reduced (summed) over the TP group in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g, group=ctx.group)
        return g, None


class SharedInput(ParallelStyle):
    """`shared_input`: the module's first input feeds every rank's share of the heads (module docstring)."""

    def _apply(self, module, mesh):
        group = mesh.get_group()
        module.register_forward_pre_hook(lambda m, args: (_SumGradOverTP.apply(args[0], group),) + tuple(args[1:]))
        return module


class EmbeddingParallel(RowwiseParallel):
    """`RowwiseParallel` on the embedding, whose output is a plain tensor that has waited for its collective.

    torch returns the output of this (asynchronous) redistribution as an `AsyncCollectiveTensor`; fed into a
    compiled block (`training.compile`), the block's backward hands that input's gradient back as a plain tensor,
    which the redistribution's backward cannot take ("'Tensor' object has no attribute '_local_tensor'", torch
    2.13, measured). `clone` waits for the collective and keeps the autograd graph (`wait()` would cut it)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out


def _forward_on(module: nn.Module, swap: Callable[[nn.Parameter], torch.Tensor]) -> None:
    """Run the module's forward with each of its own parameters replaced by `swap(parameter)` (module hooks, e.g.
    FSDP's gather, still run around it)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        saved = dict(module._parameters)
        module._parameters.update({n: swap(p) for n, p in saved.items() if p is not None})
        try:
            return inner(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    module.forward = forward


class LocalHeads(ParallelStyle):
    """Per-head parameters of a module between column-wise and row-wise projections (GPT-OSS's sinks, Cohere's q/k
    norms): split on dim 0 with the heads this rank's column-wise projections give it, and the module's forward
    run on the local shards (its gradient is this rank's own; nothing to reduce)."""

    def _apply(self, module, mesh):
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)],
                                                                           src_data_rank=None),
                                                         requires_grad=p.requires_grad))
        _forward_on(module, lambda p: p.to_local() if isinstance(p, DTensor) else p)
        return module


class ReplicateGradSum(ParallelStyle):
    """`replicate_grad_sum`: whole parameters used on this rank's heads only; their gradient summed over TP."""

    def _apply(self, module, mesh):
        group = mesh.get_group()
        _forward_on(module, lambda p: _SumGradOverTP.apply(p, group) if p.requires_grad else p)
        return module


def _styles(sequence_parallel: bool, save_shard: bool) -> dict[str, ParallelStyle]:
    seq = Shard(1) if sequence_parallel else Replicate()
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(output_layouts=seq),
        "rowwise_full": RowwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": SequenceParallel(),
        "sequence_parallel_residual": SequenceParallel(use_local_output=True),
        "sequence_gather": SequenceGather(save_shard),
        "sequence_gather_scatter": SequenceGatherScatter(save_shard),
        "shared_input": SharedInput(),
        "vocab_embedding": EmbeddingParallel(input_layouts=Replicate(), output_layouts=seq),
        "vocab_output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "local_heads": LocalHeads(),
        "colwise_gather": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split": RowwiseParallel(input_layouts=Replicate()),
        "replicate_grad_sum": ReplicateGradSum(),
        "head_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


# ------------------------------------------------------------------------------ apply
@contextlib.contextmanager
def _tp_loss_context(vocab_parallel: bool) -> Iterator[None]:
    with loss_parallel() if vocab_parallel else contextlib.nullcontext(), head_loss_override(tp_head_loss):
        yield


def apply_tp(model: nn.Module, mesh_ctx, dcfg) -> Callable[[], AbstractContextManager]:
    """Shard `model` in place over the `tp` mesh; returns the loss context (vocabulary-parallel loss, plain or
    fused). Raises ConfigError (before any step) for a bad plan."""
    tp, sp = mesh_ctx.tp_size, bool(dcfg.sequence_parallel)
    problems = plan_problems(model, tp, sp, dcfg.tp_plan)
    if problems:
        raise ConfigError(problems)
    resolved, declared, _ = resolve_plan(model, sp, dcfg.tp_plan)
    # a whole model in memory (not a pipeline stage, which takes hidden states): run it once as tp rank 0 would
    if mesh_ctx.pp_size == 1 and not any(p.is_meta for p in model.parameters()):
        added, problems = trace_plan(model, resolved, tp)
        if problems:
            raise ConfigError(problems)
        resolved.update(added)  # per-head parameters split with their heads
    styles = _styles(sp, save_shard=dcfg.ac_mode is None)
    plan: dict[str, Any] = {}
    for name, style in resolved.items():
        if style == "replicate":
            base = declared.get(name)
            if sp and base in ("vocab_embedding", "vocab_output"):
                plan[name] = ReplicateSP(gather_input=base == "vocab_output", shard_output=base == "vocab_embedding")
            continue
        plan[name] = styles[style]
    plan.update(float8_tp_styles(model, resolved, sp))  # float8 linears: torchao's styles (float8.py)
    ties = tied_parameters(model)
    adapters = _adapter_weights(model, resolved)
    # SequenceParallel re-creates parameters as trainable: frozen ones (LoRA's base) must stay frozen
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if plan:
        parallelize_module(model, mesh_ctx.mesh("tp"), plan)
    _retie(model, ties)
    _split_adapters(model, adapters, mesh_ctx.mesh("tp"))
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    return functools.partial(_tp_loss_context, "vocab_output" in resolved.values())


# LoRA factors follow their base layer's style: y = W x + B A x with W split by rows (colwise) needs B split by
# rows and A whole; with W split by columns (rowwise, input sharded) A is split by columns and B whole, the
# two partial sums (W x, B A x) reduced together by the style's output redistribution
_ADAPTER_PLACEMENTS = {"colwise": ([Replicate()], [Shard(0)]), "rowwise": ([Shard(1)], [Replicate()]),
                       "rowwise_full": ([Shard(1)], [Replicate()])}
_ADAPTER_PLACEMENTS.update(colwise_gather=_ADAPTER_PLACEMENTS["colwise"], rowwise_split=_ADAPTER_PLACEMENTS["rowwise"])


def _adapter_weights(model: nn.Module, resolved: dict[str, str]) -> dict[str, tuple]:
    """{LoRA module name: (style, A, B, dropout)}: the adapter's parts, taken out of the module while the styles
    distribute it (ColwiseParallel would shard every parameter under the module by rows, A included)."""
    out = {}
    for name, style in resolved.items():
        m = model.get_submodule(name)
        if isinstance(m, LoRALinear):
            if style not in _ADAPTER_PLACEMENTS:
                raise ConfigError(f"peft: {name} is adapted but its tensor-parallel style is {style!r}: LoRA "
                                  f"follows {' or '.join(_ADAPTER_PLACEMENTS)} only; drop it from peft.target_modules")
            out[name] = (style, m.lora_A, m.lora_B, m.lora_dropout)
            del m.lora_A, m.lora_B, m.lora_dropout  # the styles partition every submodule
    return out


def _split_adapters(model: nn.Module, adapters: dict, mesh) -> None:
    """Put the factors back, split as their base layer's style requires (every rank holds the full value)."""
    for name, (style, a, b, dropout) in adapters.items():
        m = model.get_submodule(name)
        for part, placements in zip((a, b), _ADAPTER_PLACEMENTS[style]):
            part.weight = nn.Parameter(distribute_tensor(part.weight.detach(), mesh, placements, src_data_rank=None))
        m.lora_A, m.lora_B, m.lora_dropout = a, b, dropout


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """parallelize_module distributes each module's weight separately, which would silently untie shared
    weights: point every name of a group back at the first one's (now distributed) parameter."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ConfigError(f"tied parameters {names[0]!r} and {name!r} get different tensor-parallel "
                                  f"placements ({getattr(first, 'placements', 'whole')} vs "
                                  f"{getattr(other, 'placements', 'whole')}): give both modules matching styles "
                                  "in distributed.tp_plan or untie them")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
