"""One traced rank's run, built as `Trainer.build` builds a real one, without data and weights.

Rules -> MeshContext -> `build_parallel_model` on the meta device, materialised under the fake mode and left
uninitialised (`shape_only`: values are never read) -> optimizer and schedule -> a `Trainer`, whose
`train_step` is the step traced. What a fake world needs beyond that, each because fake tensors have no values:
- MoE layers route balanced (`MoE.balanced_routing`: token copy i to expert i % n_experts), so every split of
  the expert all-to-alls is known; a real router's load depends on the data (the plan counts it balanced too).
- Pipeline stages get their input and output examples up front (torch's static stage metadata,
  `PipelineParallelModel.set_stage_examples`): torch's first-step metadata inference sends pickled metadata
  between pp ranks, which a fake group cannot carry. Stage 0's output is probed by running the first stage's
  own modules (embedding) on this rank, parallelised alike; every later stage passes the same hidden states on.
  torch >= 2.13 also votes between pp ranks (a p2p exchange of flags read with `.item()`) on static or dynamic
  metadata: a fake group delivers no vote, so the schedule's warm-up vote is replaced by the answer every rank
  would give (static).
- The optimizer's state exists before the traced step (a steady-state step): one step on zero gradients.
"""

from __future__ import annotations

import contextlib

import torch

from meshforge.config import rules as config_rules
from meshforge.distributed.build import build_parallel_model
from meshforge.distributed.env import DistInfo
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.parallelize import parallelize_model
from meshforge.distributed.pipeline import PipelineParallelModel, prune_to_stage
from meshforge.errors import ConfigError
from meshforge.models import build_model, contract_of, resolve_model_args
from meshforge.training.optim import build_optimizer, build_scheduler
from meshforge.training.trainer import Trainer


def build_rank(cfg, world_size: int, rank: int, fake) -> Trainer:
    """The trainer of rank `rank` (fake parameters, no data loader); call inside `world.fake_world`."""
    problems = config_rules.check(cfg, world_size)
    if problems:
        raise ConfigError(problems)
    info = DistInfo(rank, world_size, 0, torch.device("cpu"), "fake")
    mesh_ctx = MeshContext.build(cfg.distributed, world_size, rank, "cpu")
    pm = build_parallel_model(cfg, mesh_ctx, info.device, shape_only=fake)
    with fake:
        optimizer = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.training.max_steps)
    for part in pm.unwrapped_parts():
        for layer in contract_of(part).moe_layers():
            layer.balanced_routing = True
    trainer = Trainer(cfg, info, mesh_ctx, pm, optimizer, scheduler, loader=None)
    if isinstance(pm, PipelineParallelModel):
        pm.set_stage_examples(stage_examples(cfg, trainer, fake))
        _static_metadata(pm.schedule)
    return trainer


def micro_batches(cfg, mesh_ctx, fake, n: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro batches of one step (the first `n`), as fake token ids and labels."""
    t = cfg.training
    count = t.global_batch_size // mesh_ctx.dp_size // t.micro_batch_size
    with fake:
        return [(torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long),
                 torch.zeros(t.micro_batch_size, t.seq_len, dtype=torch.long)) for _ in range(n or count)]


def warm_optimizer(trainer: Trainer, fake) -> None:
    """One optimizer step on zero gradients: the state a steady-state step starts with (AdamW's moments)."""
    with fake:
        for group in trainer.optimizer.param_groups:
            for p in group["params"]:
                # a strategy that binds the optimizer's leaves to its own gradient buffers (megatron_fsdp: views
                # of its main gradients) keeps them: a new tensor here would leave the rank holding a second copy
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    if hasattr(p, "main_grad"):  # bf16_params' fp32 gradients (distributed/master_weights.py)
                        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        trainer.optimizer.step()
        trainer.pm.zero_grad(trainer.optimizer)


def stage_examples(cfg, trainer: Trainer, fake) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{stage: (example input, example output)} of this rank's stages, for one micro batch."""
    pm, mesh_ctx = trainer.pm, trainer.mesh_ctx
    plan = pm.plan
    with fake:
        tokens = torch.zeros(plan.microbatch_size, cfg.training.seq_len // mesh_ctx.cp_size, dtype=torch.long)
    hidden = _stage0_output(cfg, mesh_ctx, fake, tokens)
    args = resolve_model_args(cfg.model)
    out = {}
    with fake:
        for s, part in zip(pm.stage_ids, pm.parts):
            inp = tokens if s == 0 else torch.empty_like(hidden, requires_grad=True)
            if s == plan.num_stages - 1:
                res = torch.empty(*tokens.shape, args.vocab_size // mesh_ctx.tp_size, requires_grad=True)
                if args.aux_loss_coeff > 0 and contract_of(pm.strategy.unwrap(part)).moe_layers():
                    res = (res, torch.empty((), requires_grad=True))  # an MoE's last stage: (logits, aux loss)
            else:
                res = torch.empty_like(hidden, requires_grad=True)
            out[s] = (inp, res)
    return out


def _stage0_output(cfg, mesh_ctx, fake, tokens: torch.Tensor) -> torch.Tensor:
    """What stage 0 hands on for one micro batch (shape and dtype): its first-stage modules (the embedding), built
    and parallelised on this rank as stage 0's rank builds them, run once under the run's autocast."""
    module = prune_to_stage(build_model(cfg.model, device="meta"), (), first=True, last=False)
    t = cfg.training  # parallelised as `distributed.pipeline.build_pipeline_model` parallelises a stage
    part = parallelize_model(module, mesh_ctx, cfg.distributed, torch.device("cpu"), stage=True)
    with fake:
        part.strategy.materialize(part.model, cfg.run.seed, init=False)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if t.precision == "bf16" \
            else contextlib.nullcontext()
        with torch.no_grad(), autocast:
            h = part.model(tokens)
    if not isinstance(h, torch.Tensor) or type(h).__name__ == "DTensor":
        raise ConfigError(f"the scale trace cannot trace this pipeline: stage 0 hands on {type(h).__name__}, "
                          "not a plain tensor")
    with fake:
        return torch.empty(h.shape, dtype=h.dtype)


def _static_metadata(schedule) -> None:
    """Replace torch's warm-up vote (torch >= 2.13: `_warmup_p2p`) by its answer when every stage has static
    metadata; older torch skips its shape inference when the examples are given."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote
