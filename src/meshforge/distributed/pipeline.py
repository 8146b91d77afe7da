"""Pipeline parallelism: split the model into stages, parallelise each stage, drive them with a torch schedule.

`build_pipeline_model(cfg, mesh_ctx, device, meta)` (called by the trainer when
pp_size > 1) returns a `PipelineParallelModel`:

- The split is `planning.pipeline_plan.plan_pipeline` (the plan `config.rules`
  validated): the model's declared `pp_split_points()` (its blocks, in order) are
  cut into contiguous runs; the embedding goes with the first stage, the final
  norm and output with the last. Stage s runs on pp rank s % pp (loop-style
  schedules) or in a V (v_schedule).
- A stage is the whole model built (on meta for large models) with the modules
  of other stages removed, so every parameter keeps the whole model's name:
  initialisation by (seed, name) gives the single-process weights, and
  checkpoints move between PP and non-PP runs without renaming.
- Each stage then goes through `parallelize_model` (TP, AC, compile, strategy;
  FSDP2 shards it over this stage's dp mesh). Under PP, FSDP2 keeps parameters
  gathered across microbatches (`reshard_after_forward` defaults to False) unless
  the user set it; torch's stage turns gradient sync off for every microbatch
  but the reduce at the end of the schedule step.
- One schedule step per optimizer step carries this rank's whole share of the
  global batch (the trainer's micro batches concatenated), split into
  microbatches of `pp_microbatch_size`. The loss (cross-entropy mean of a
  microbatch, on the last stage) is scaled by 1/n_microbatches either by the
  schedule (`scale_grads_in_schedule: true`) or in the loss (false): the mean
  over all microbatches equals the single-process mean over the global batch.
- The logged loss is broadcast from the last stage's rank over the pp group,
  then averaged over dp like any other run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from meshforge.config import ConfigError
from meshforge.planning.pipeline_plan import (
    TORCH_SCHEDULE_CLASS,
    PipelinePlan,
    PipelinePlanError,
    plan_pipeline,
)
from meshforge.training.step import ParallelModel, lm_loss

FIRST_STAGE_MODULES = ("tok_embeddings",)
LAST_STAGE_MODULES = ("norm", "output")


def schedule_class(name: str):
    """The torch schedule class for a `pp_schedule` name; a ConfigError naming the torch version if absent."""
    from torch.distributed.pipelining import schedules

    cls_name = TORCH_SCHEDULE_CLASS[name]
    cls = getattr(schedules, cls_name, None)
    if cls is None:
        have = [n for n, c in TORCH_SCHEDULE_CLASS.items() if hasattr(schedules, c)]
        msg = (f"distributed.pipeline.pp_schedule={name} needs torch.distributed.pipelining.{cls_name}, which "
               f"torch {torch.__version__} does not have: choose one of {', '.join(have)} or upgrade torch")
        raise ConfigError([msg])
    return cls


def plan_for(cfg, mesh_ctx) -> PipelinePlan:
    from meshforge.models import resolve_model_args

    args = resolve_model_args(cfg.model)
    local_batch = cfg.training.global_batch_size // mesh_ctx.dp_size
    try:
        return plan_pipeline(args.n_layers, mesh_ctx.pp_size, cfg.distributed.pipeline_or_default, local_batch)
    except PipelinePlanError as err:
        raise ConfigError(err.problems) from None


def prune_to_stage(model: nn.Module, layers: tuple[int, ...], first: bool, last: bool) -> nn.Module:
    """Delete every block not in `layers` (by the model's split points) and the first/last-only modules."""
    points = model.pp_split_points()
    keep = {points[i] for i in layers}
    for name in points:
        if name not in keep:
            parent, _, child = name.rpartition(".")
            delattr(model.get_submodule(parent) if parent else model, child)
    for names, keep_them in ((FIRST_STAGE_MODULES, first), (LAST_STAGE_MODULES, last)):
        if not keep_them:
            for n in names:
                if getattr(model, n, None) is not None:
                    setattr(model, n, None)
    return model


def build_stage_module(cfg, plan: PipelinePlan, stage: int, device: torch.device, meta: bool) -> nn.Module:
    """Stage `stage` of the model, with the whole model's parameter names; initialised unless `meta`."""
    from meshforge.models import build_model, init_weights

    model = build_model(cfg.model, device="meta" if meta else None)
    prune_to_stage(model, plan.stage_layers[stage], stage == 0, stage == plan.num_stages - 1)
    if not meta:
        init_weights(model, cfg.run.seed)  # a function of (seed, name) only: equals the single-process init
        model.to(device)
    return model


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _full_positions_from_sequence_shard(module: nn.Module, tp: int) -> None:
    """Under sequence parallelism a later stage receives a sequence shard (B, S/tp, dim) of the hidden states;
    the model derives RoPE positions from its input's length, so pass the whole sequence's positions."""

    def hook(mod, args, kwargs):
        if kwargs.get("positions") is None and len(args) < 2:
            kwargs = dict(kwargs, positions=torch.arange(args[0].shape[1] * tp, device=args[0].device))
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _stage_dcfg(dcfg):
    """FSDP2 under PP keeps parameters gathered across microbatches unless the user chose otherwise."""
    if dcfg.strategy == "fsdp2" and dcfg.reshard_after_forward is None:
        return dcfg.model_copy(update={"reshard_after_forward": False})
    return dcfg


class PipelineParallelModel(ParallelModel):
    """The stages this rank runs (`parts`, in stage order) and the schedule that drives them."""

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], plan: PipelinePlan, strategy, mesh_ctx,
                 device: torch.device, precision: str, scale_grads_in_schedule: bool, shell_factory=None):
        super().__init__(parts[0], strategy, mesh_ctx, device, precision)
        from torch.distributed.pipelining import PipelineStage

        self.parts = list(parts)
        self.plan, self.stage_ids = plan, stage_ids
        self.scale_in_schedule = scale_grads_in_schedule
        self.pp_group = mesh_ctx.group("pp")
        self.has_first = 0 in stage_ids
        self.has_last = plan.num_stages - 1 in stage_ids
        self.stages = [PipelineStage(part, s, plan.num_stages, device, group=self.pp_group)
                       for part, s in zip(parts, stage_ids)]
        last_part = parts[stage_ids.index(plan.num_stages - 1)] if self.has_last else None
        self._loss_ctx = getattr(last_part, "_meshforge_loss_context", None)
        self._ces: list[torch.Tensor] = []
        self._merged: nn.Module | None = None
        self._shell_factory = shell_factory
        cls = schedule_class(plan.schedule)
        kwargs = {"n_microbatches": plan.n_microbatches, "loss_fn": self._loss_fn,
                  "scale_grads": scale_grads_in_schedule}
        self.schedule = cls(self.stages[0], **kwargs) if plan.single_stage else cls(self.stages, **kwargs)

    def _loss_fn(self, output, target: torch.Tensor) -> torch.Tensor:
        ce, aux = lm_loss(output, target)  # inside the loss context `forward_backward` opens
        self._ces.append(ce.detach().float())
        loss = ce if aux is None else ce + aux
        return loss if self.scale_in_schedule else loss / self.plan.n_microbatches

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One schedule step over this rank's whole batch; returns the mean cross-entropy (same on every rank)."""
        x = torch.cat([mb[0] for mb in micro_batches]).to(self.device, non_blocking=True)
        y = torch.cat([mb[1] for mb in micro_batches]).to(self.device, non_blocking=True)
        self._ces = []
        args = (x,) if self.has_first else ()
        # the loss context (vocabulary-parallel loss under TP) must also cover the loss's backward, which the
        # schedule runs later, outside `_loss_fn`: it wraps the whole step (it only touches the loss ops)
        with self.autocast(), (self._loss_ctx or contextlib.nullcontext)():
            self.schedule.step(*args, target=y if self.has_last else None, return_outputs=False)
        for part in self.parts:
            self.strategy.finish_grad_sync(part)
        if self.has_last:
            n = self.plan.n_microbatches  # the first step also runs the loss once to infer stage metadata
            if len(self._ces) < n:
                raise RuntimeError(f"pipeline computed {len(self._ces)} losses for {n} microbatches")
            loss = torch.stack(self._ces[-n:]).mean().to(self.device)
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.plan.last_stage_rank)
        return self.reduce_loss(loss)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The strategy's groups of every local stage, merged by hyperparameters (and DTensor or not, which
        foreach optimizers cannot mix): the same groups as a non-PP run, so optimizer checkpoints
        (`optim.param_groups.<i>.*`) interchange."""
        from torch.distributed.tensor import DTensor

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
                for n in stage.pp_split_points():
                    _set_submodule(shell, n, stage.get_submodule(n))
                for attr in FIRST_STAGE_MODULES + LAST_STAGE_MODULES:
                    if getattr(stage, attr, None) is not None:
                        setattr(shell, attr, getattr(stage, attr))
            self._merged = shell
        return [self._merged]

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        # always the multi-part path: it adds the squares of every stage over the pp group
        from meshforge.distributed.grad_norm import clip_grad_norm_

        params = [p for part in self.parts for p in part.parameters()]
        return clip_grad_norm_(params, max_norm, self.mesh_ctx)


def build_pipeline_model(cfg, mesh_ctx, device: torch.device, meta: bool = False) -> PipelineParallelModel:
    from meshforge.distributed.parallelize import parallelize_model

    plan = plan_for(cfg, mesh_ctx)
    schedule_class(plan.schedule)  # fail before building anything if torch lacks it
    dcfg = _stage_dcfg(cfg.distributed)
    stage_ids = plan.rank_stages(mesh_ctx.pp_rank)
    parts, strategy = [], None
    for s in stage_ids:
        module = build_stage_module(cfg, plan, s, device, meta)
        if s > 0 and dcfg.sequence_parallel and mesh_ctx.tp_size > 1:
            _full_positions_from_sequence_shard(module, mesh_ctx.tp_size)
        part, strategy = parallelize_model(module, mesh_ctx, dcfg, device, compile=cfg.training.compile)
        if meta:
            strategy.materialize(part, cfg.run.seed)
        if cfg.model.init_from:
            from meshforge.checkpoint.hf import load_hf_into

            load_hf_into(strategy.unwrap(part), cfg.model.init_from)
        parts.append(part)
    def shell():
        from meshforge.models import build_model

        return prune_to_stage(build_model(cfg.model, device="meta"), (), first=False, last=False)

    return PipelineParallelModel(parts, stage_ids, plan, strategy, mesh_ctx, device, cfg.training.precision,
                                 cfg.distributed.pipeline_or_default.scale_grads_in_schedule, shell_factory=shell)
