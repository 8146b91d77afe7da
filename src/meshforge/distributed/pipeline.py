"""Pipeline parallelism: split the model into stages, parallelise each stage, drive them with a torch schedule.

`build_pipeline_model(cfg, mesh_ctx, device, meta)` (called by `distributed.build` when
pp_size > 1) returns a `PipelineParallelModel`:

- The split is `planning.pipeline_plan.plan_pipeline` (the plan `config.rules`
  validated): the split points of the model's pipeline layout (its blocks, in
  order; the model contract) are cut into contiguous runs; the layout's
  first-stage modules go with the first stage, its last-stage modules with the
  last. Stage s runs on pp rank s % pp (loop-style schedules) or in a V (v_schedule).
- A stage is the whole model built (on meta for large models) with the modules
  of other stages removed, so every parameter keeps the whole model's name:
  initialisation by (seed, name) gives the single-process weights, and
  checkpoints move between PP and non-PP runs without renaming.
- Each stage then goes through `parallelize_model` (TP, AC, compile, strategy;
  FSDP2 shards it over this stage's dp mesh). Under PP, FSDP2 keeps parameters
  gathered across microbatches (its `reshard_after_forward` default under PP)
  unless the user set it; torch's stage turns gradient sync off for every
  microbatch but the reduce at the end of the schedule step.
- One schedule step per optimizer step carries this rank's whole share of the
  global batch (the trainer's micro batches concatenated), split into
  microbatches of `pp_microbatch_size`. The loss of a microbatch (on the last
  stage) is its cross-entropy sum times (dp*cp) / the global batch's label
  count (`ParallelModel.global_label_count`, taken before the step), as in a
  non-PP run; under `scale_grads_in_schedule: true` the schedule divides by
  n_microbatches, so the loss is multiplied by it first.
- The logged loss (the cross-entropy sum) is broadcast from the last stage's
  rank over the pp group, then summed over dp and divided by the count.
- Packed sequences: the document ids and restarting positions are keyword inputs of the schedule step, which
  splits them into microbatches with the inputs and hands them to every stage.
- MoE stages (`pipeline_moe.py`): each non-last stage attaches its aux loss to its output, counted once per
  microbatch; weights tied across the first and the last stage (`pipeline_ties.py`): the last stage holds a
  copy, the two gradients are summed every step.
- Uneven ends and any number of stages per rank come from the plan (`first_stage_layers`, `last_stage_layers`,
  `virtual_stages_per_rank`): a stage may hold no block (the embedding alone, the head alone).
- Every stage takes the run's numerics as a whole model would: float8 linears,
  bf16_params (the strategy's fp32 shards, or the stage cast to bf16 with its
  masters in the optimizer), and the fused loss on the last stage, whose
  forward then returns the head's input (`_HeadHandOff` carries the head's
  weight to the loss beside the stage's output).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.pipelining import schedules
from torch.distributed.tensor import DTensor

from meshforge.distributed.context_parallel import load_balanced_indices
from meshforge.distributed.grad_norm import clip_grad_norm_
from meshforge.distributed.master_weights import keep_masters
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.parallelize import Parallelized, parallelize_model, set_fused_loss
from meshforge.distributed.pipeline_moe import Stage, aux_loss_weight, carry_aux_loss
from meshforge.distributed.pipeline_ties import TiedEnds, stage_aliases, whole_model_ties
from meshforge.distributed.runtime import ParallelModel, packed_positions
from meshforge.errors import ConfigError, PipelinePlanError
from meshforge.models import (
    build_model,
    contract_of,
    init_weights,
    resolve_model_args,
    set_submodule,
    submodule_or_none,
)
from meshforge.models.lora import apply_lora
from meshforge.models.loss import HeadInput, lm_loss
from meshforge.planning.pipeline_plan import TORCH_SCHEDULE_CLASS, PipelinePlan, plan_pipeline


def schedule_class(name: str):
    """The torch schedule class for a `pp_schedule` name; a ConfigError naming the torch version if absent."""
    cls_name = TORCH_SCHEDULE_CLASS[name]
    cls = getattr(schedules, cls_name, None)
    if cls is None:
        have = [n for n, c in TORCH_SCHEDULE_CLASS.items() if hasattr(schedules, c)]
        msg = (f"distributed.pipeline.pp_schedule={name} needs torch.distributed.pipelining.{cls_name}, which "
               f"torch {torch.__version__} does not have: choose one of {', '.join(have)} or upgrade torch")
        raise ConfigError([msg])
    return cls


def plan_for(cfg, mesh_ctx) -> PipelinePlan:
    args = resolve_model_args(cfg.model)
    local_batch = cfg.training.global_batch_size // mesh_ctx.dp_size
    try:
        return plan_pipeline(args.n_layers, mesh_ctx.pp_size, cfg.distributed.pipeline_or_default, local_batch)
    except PipelinePlanError as err:
        raise ConfigError(err.problems) from None


def prune_to_stage(model: nn.Module, blocks: tuple[int, ...], first: bool, last: bool) -> nn.Module:
    """Delete every split point (block) not in `blocks` and, unless this is the first/last stage, the
    layout's first/last-stage modules (set to None: the model's forward then passes hidden states through)."""
    layout = contract_of(model).pipeline_layout()
    keep = {layout.split_points[i] for i in blocks}
    for name in layout.split_points:
        if name not in keep:
            parent, _, child = name.rpartition(".")
            delattr(model.get_submodule(parent) if parent else model, child)
    for names, keep_them in ((layout.first_stage, first), (layout.last_stage, last)):
        if not keep_them:
            for n in names:
                set_submodule(model, n, None)
    return model


def build_stage_module(cfg, plan: PipelinePlan, stage: int, device: torch.device, meta: bool,
                       ties: list[list[str]] = ()) -> tuple[nn.Module, dict[str, str]]:
    """Stage `stage` of the model, with the whole model's parameter names, initialised unless `meta`; and its
    copies of weights tied to another stage ({name: the tied weight's first name}, `pipeline_ties`; `ties`: the
    whole model's tied names)."""
    model = build_model(cfg.model, device="meta" if meta else None)
    if contract_of(model).pipeline_layout() is None:
        raise ConfigError(f"distributed.pp_size={plan.pp}: the model ({type(model).__name__}) declares no pipeline "
                          "layout: use a built-in model or pp_size 1")
    prune_to_stage(model, plan.stage_layers[stage], stage == 0, stage == plan.num_stages - 1)
    aliases = stage_aliases(ties, model)
    if cfg.peft is not None:  # adapters on the stage's own layers, initialised by name like everything else
        apply_lora(model, cfg.peft)
    if not meta:  # a function of (seed, name) only: equals the single-process init (a tied copy: its first name's)
        init_weights(model, cfg.run.seed, names=aliases)
        model.to(device)
    return model, aliases


def _stage_positions(module: nn.Module, seq_shard: int, cp_size: int, cp_rank: int) -> None:
    """The RoPE positions of a stage's input, which the schedule does not carry (it passes one tensor between
    stages): a sequence-parallel later stage receives a 1/tp sequence shard of the hidden states
    (`seq_shard` = tp), and under context parallelism every stage holds this cp rank's load-balanced chunks
    (`context_parallel.load_balanced_indices`), whose positions are not 0..n-1."""

    def hook(mod, args, kwargs):
        if kwargs.get("positions") is None and len(args) < 2:
            n = args[0].shape[1] * seq_shard * cp_size
            device = args[0].device
            positions = (torch.arange(n, device=device) if cp_size == 1
                         else load_balanced_indices(n, cp_size, cp_rank, device=device))
            kwargs = dict(kwargs, positions=positions)
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


class _HeadHandOff:
    """The fused loss on the last stage: its forward returns `HeadInput(hidden, weight)`, and torch's stage
    detaches in place, after their backward, the tensors its last stage returned: the head's weight (a
    parameter) must not be one of them, or it would stop learning. A forward hook gives the stage the hidden
    states only and keeps the weight for the loss (the same parameter for every microbatch)."""

    def __init__(self, module: nn.Module):
        self.weight: torch.Tensor | None = None
        module.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        whole = type(out) is tuple  # (HeadInput, aux) from an MoE
        head = out[0] if whole else out
        if not isinstance(head, HeadInput):  # logits (evaluation, or the plain loss)
            self.weight = None
            return out
        self.weight = head.weight
        return (head.hidden, *out[1:]) if whole else head.hidden

    def rejoin(self, output):
        """The stage's output with the head's input rebuilt for the loss."""
        if self.weight is None:
            return output
        if type(output) is tuple:
            return (HeadInput(output[0], self.weight), *output[1:])
        return HeadInput(output, self.weight)


class PipelineParallelModel(ParallelModel):
    """The stages this rank runs (`parts`, in stage order) and the schedule that drives them."""

    def __init__(self, parts: list[Parallelized], stage_ids: list[int], plan: PipelinePlan, mesh_ctx: MeshContext,
                 device: torch.device, precision: str, scale_grads_in_schedule: bool, shell_factory,
                 ties: list[list[str]] = (), tied_aliases: dict[int, dict[str, str]] | None = None):
        super().__init__(parts, mesh_ctx, device, precision)
        self.plan, self.stage_ids = plan, stage_ids
        self.scale_in_schedule = scale_grads_in_schedule
        self.pp_group = mesh_ctx.group("pp")
        self.has_first = 0 in stage_ids
        self.has_last = plan.num_stages - 1 in stage_ids
        self.stages = [Stage(part, s, plan.num_stages, device, group=self.pp_group,
                              moe_layers=contract_of(self.strategy.unwrap(part)).moe_layers())
                       for part, s in zip(self.parts, stage_ids)]
        # the loss runs on the last stage, under that stage's loss context (vocabulary-parallel loss under TP)
        self.loss_context = parts[stage_ids.index(plan.num_stages - 1)].loss_context if self.has_last \
            else contextlib.nullcontext
        self._head = _HeadHandOff(self.parts[stage_ids.index(plan.num_stages - 1)]) if self.has_last else None
        self._ces: list[torch.Tensor] = []
        self._scale: torch.Tensor | None = None  # (dp*cp) / the step's global label count, set per step
        self._merged: nn.Module | None = None
        self._shell_factory = shell_factory
        stages = {s: self.strategy.unwrap(p) for s, p in zip(stage_ids, self.parts)}
        self.tied = TiedEnds(stages, ties, tied_aliases or {}, plan.num_stages, plan.stage_rank, mesh_ctx)
        self.schedule = self._make_schedule()

    def _make_schedule(self):
        cls = schedule_class(self.plan.schedule)
        kwargs = {"n_microbatches": self.plan.n_microbatches, "loss_fn": self._loss_fn,
                  "scale_grads": self.scale_in_schedule}
        return cls(self.stages[0], **kwargs) if self.plan.single_stage else cls(self.stages, **kwargs)

    def set_stage_examples(self, examples: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give every local stage an example input and output (stage id -> (input, output), tensors with the
        shapes, dtypes and requires_grad of one micro batch's): torch's static stage metadata. The schedule then
        runs no metadata-inference pass on its first step (an extra forward and backward per stage, and pickled
        metadata sent between pp ranks), which a fake process group (the scale trace) cannot carry."""
        self.stages = [Stage(part, s, self.plan.num_stages, self.device, input_args=examples[s][0],
                             output_args=examples[s][1], group=self.pp_group,
                             moe_layers=contract_of(self.strategy.unwrap(part)).moe_layers())
                       for part, s in zip(self.parts, self.stage_ids)]
        self.schedule = self._make_schedule()

    def _loss_fn(self, output, target: torch.Tensor) -> torch.Tensor:
        parts = lm_loss(self._head.rejoin(output), target)  # inside the loss context `forward_backward` opens
        self._ces.append(parts.ce_sum.detach().float())
        n = self.plan.n_microbatches
        loss = parts.ce_sum * self._scale * (n if self.scale_in_schedule else 1)  # after the schedule's own scaling
        if parts.aux is not None:  # the last stage's MoE layers (the others attach theirs: `carry_aux_loss`)
            loss = loss + parts.aux * aux_loss_weight(self.plan, self.scale_in_schedule)
        return loss

    def _rank_batch(self, micro_batches: list[tuple[torch.Tensor, ...]], clamp: bool = True):
        """This rank's whole batch for one schedule step: (inputs, labels, the stages' keyword inputs, the global
        label count). Packed sequences bring their document ids and restarting positions as keyword inputs, which
        the schedule splits into microbatches with the inputs and hands to every stage (each masks its attention
        by document; an MoE stage keeps padding out of its router statistics)."""
        x, y, *docs = (torch.cat(parts).to(self.device, non_blocking=True) for parts in zip(*micro_batches))
        count = self.global_label_count([y], clamp=clamp)
        kwargs = {}
        if docs:  # (config rules refuse packing with cp under pp: cp's mask reads one micro batch's ids at a time)
            kwargs = {"positions": packed_positions(docs[0]), "document_ids": docs[0]}
        if self.batch_transform is not None:  # this cp rank's share; the stages add its positions
            x, y, _ = self.batch_transform(x, y)
        return x, y, kwargs, count

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One schedule step over this rank's whole batch; returns the mean cross-entropy (same on every rank)."""
        x, y, kwargs, count = self._rank_batch(micro_batches)
        self._ces = []
        self._scale = self.mesh_ctx.size("dp_cp") / count
        args = (x,) if self.has_first else ()
        # the loss context (vocabulary-parallel loss under TP) must also cover the loss's backward, which the
        # schedule runs later, outside `_loss_fn`: it wraps the whole step (it only touches the loss ops)
        with self.autocast(), self.loss_context():
            self.schedule.step(*args, target=y if self.has_last else None, return_outputs=False, **kwargs)
        for part in self.parts:
            self.strategy.finish_grad_sync(part)
        self.tied.sum_grads()
        if self.has_last:
            n = self.plan.n_microbatches  # the first step also runs the loss once to infer stage metadata
            if len(self._ces) < n:
                raise RuntimeError(f"pipeline computed {len(self._ces)} losses for {n} microbatches")
        return self.reduce_loss(self._last_stage_sum(), count)

    def _last_stage_sum(self) -> torch.Tensor:
        """The step's cross-entropy sum (the last `n_microbatches` losses), from the last stage to every pp rank."""
        n = self.plan.n_microbatches
        total = torch.stack(self._ces[-n:]).sum().to(self.device) if self.has_last \
            else torch.zeros((), device=self.device)
        dist.broadcast(total, group=self.pp_group, group_src=self.plan.last_stage_rank)
        return total

    @torch.no_grad()
    def evaluate(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only through the schedule (`schedule.eval`): (cross-entropy sum, label count), every rank."""
        x, y, kwargs, count = self._rank_batch(micro_batches, clamp=False)
        self._ces, self._scale = [], torch.ones((), device=self.device)
        with self.autocast(), self.loss_context():
            self.schedule.eval(*((x,) if self.has_first else ()), target=y if self.has_last else None, **kwargs)
        return self.reduce_loss(self._last_stage_sum(), torch.ones((), device=self.device)), count

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The strategy's groups of every local stage, merged by hyperparameters (and DTensor or not, which
        foreach optimizers cannot mix): the same groups as a non-PP run, so optimizer checkpoints
        (`optim.param_groups.<i>.*`) interchange."""

        def key(g):
            return ({k: v for k, v in g.items() if k != "params"}, isinstance(g["params"][0], DTensor))

        merged: list[dict] = []
        for g in super().param_groups(weight_decay):
            for m in merged:
                if key(m) == key(g):
                    m["params"] = list(m["params"]) + list(g["params"])
                    break
            else:
                merged.append(dict(g, params=list(g["params"])))
        return merged

    def unwrapped_parts(self) -> list[nn.Module]:
        """One module holding every local stage's modules under the whole model's names (checkpoint, export).

        With one stage per rank that is the stage itself; with several, a parameter-less shell of the model
        whose blocks/embedding/output are the stages' own modules (shared parameters, no copies), so
        `get_model_state_dict`/`get_optimizer_state_dict`, which take one module, see all of this rank's
        parameters by their whole-model names.
        """
        stages = [self.strategy.unwrap(p) for p in self.parts]
        if len(stages) == 1:
            return stages
        if self._merged is None:
            shell = self._shell_factory()  # the model with no blocks and no first/last modules, on meta
            for stage in stages:
                layout = contract_of(stage).pipeline_layout()
                for n in layout.split_points + layout.first_stage + layout.last_stage:
                    module = submodule_or_none(stage, n)
                    if module is not None:
                        set_submodule(shell, n, module)
            self._merged = shell
        return [self._merged]

    def state_parts(self) -> list[nn.Module]:
        return self.unwrapped_parts() if len(self.parts) > 1 else self.parts

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's full weights, gathered from all pp ranks (stages hold different names)."""
        mine = super().full_state_dict()
        everyone: list = [None] * self.mesh_ctx.world_size
        dist.all_gather_object(everyone, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in everyone:
            merged.update(part or {})
        return merged

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        # always the multi-part path: it adds the squares of every stage over the pp group; a tied weight's copy on
        # the last stage is clipped but not counted (the first stage counts the weight)
        params = [p for part in self.parts for p in part.parameters()]
        return clip_grad_norm_(params, max_norm, self.mesh_ctx, uncounted=self.tied.copy_params())

    def optimizer_state_dict(self, optimizer, full: bool = False) -> dict:
        return self.tied.to_canonical(super().optimizer_state_dict(optimizer, full))

    def load_optimizer_state_dict(self, optimizer, state_dict: dict) -> None:
        super().load_optimizer_state_dict(optimizer, self.tied.from_canonical(state_dict))


def _stage_numerics(cfg, module: nn.Module, last: bool) -> dict:
    """What a stage takes of the run's numerics: float8 linears, the precision, and the fused loss (the last
    stage's forward hands the loss the head's input)."""
    return {"fp8": cfg.training.fp8, "precision": cfg.training.precision,
            "fused_loss": set_fused_loss(module, cfg) and last}


def build_pipeline_model(cfg, mesh_ctx: MeshContext, device: torch.device, meta: bool = False,
                         shape_only: contextlib.AbstractContextManager | None = None) -> PipelineParallelModel:
    plan = plan_for(cfg, mesh_ctx)
    schedule_class(plan.schedule)  # fail before building anything if torch lacks it
    dcfg = cfg.distributed
    scale_in_schedule = dcfg.pipeline_or_default.scale_grads_in_schedule
    stage_ids = plan.rank_stages(mesh_ctx.pp_rank)
    parts, aliases = [], {}
    ties = whole_model_ties(build_model(cfg.model, device="meta"))
    for s in stage_ids:
        module, aliases[s] = build_stage_module(cfg, plan, s, device, meta, ties)
        seq_shard = mesh_ctx.tp_size if s > 0 and dcfg.sequence_parallel else 1
        if seq_shard > 1 or mesh_ctx.cp_size > 1:
            _stage_positions(module, seq_shard, mesh_ctx.cp_size, mesh_ctx.cp_rank)
        part = parallelize_model(module, mesh_ctx, dcfg, device, compile=cfg.training.compile,
                                 compile_backend=cfg.training.compile_backend, stage=True,
                                 **_stage_numerics(cfg, module, last=s == plan.num_stages - 1))
        if s != plan.num_stages - 1:
            carry_aux_loss(part.model, aux_loss_weight(plan, scale_in_schedule))
        if meta:  # shape_only: see `distributed.build.build_parallel_model`
            with shape_only or contextlib.nullcontext():
                part.model = part.strategy.materialize(part.model, cfg.run.seed, init=shape_only is None,
                                                       names=aliases[s])
        keep_masters(part.model, part.strategy, cfg.training.precision)
        parts.append(part)

    def shell():
        return prune_to_stage(build_model(cfg.model, device="meta"), (), first=False, last=False)

    return PipelineParallelModel(parts, stage_ids, plan, mesh_ctx, device, cfg.training.precision,
                                 scale_in_schedule, shell_factory=shell, ties=ties, tied_aliases=aliases)
