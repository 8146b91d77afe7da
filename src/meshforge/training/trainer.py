"""The training loop: build everything from a validated Config, then step, log and checkpoint.

Read top to bottom, `train()` is the whole run:
  rules -> process group -> MeshContext -> model -> parallelize -> optimizer,
  schedule, data -> resume -> steps (forward/backward, clip, update, log, save).
It never branches on a strategy's name: strategies and parallelisms plug in
through `ParallelModel` and the `Strategy` protocol.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshforge.config import ConfigError
from meshforge.config import rules as config_rules
from meshforge.config.schema import Config
from meshforge.data import ShardedBatchLoader, build_source
from meshforge.distributed.env import destroy, init_distributed
from meshforge.distributed.mesh import MeshContext
from meshforge.models import build_model, init_weights, resolve_model_args
from meshforge.training.logger import MetricsLogger
from meshforge.training.metrics import device_peak_tflops, max_memory_gib, throughput
from meshforge.training.optim import build_optimizer, build_scheduler
from meshforge.training.step import ParallelModel


class TrainingStopped(RuntimeError):
    """A run ended early for a reason the user must see (non-finite loss); exit code 3 from the CLI."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per step run in this process, in order
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    skipped_steps: int = 0
    stopped_by_signal: bool = False
    parallel_model: ParallelModel | None = None
    optimizer: torch.optim.Optimizer | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def use_meta_init(cfg: Config, world_size: int, n_params: int) -> bool:
    if cfg.model.init_device != "auto":
        return cfg.model.init_device == "meta"
    return world_size > 1 and n_params > 500_000_000


def build_parallel_model(cfg: Config, mesh_ctx: MeshContext, device: torch.device) -> ParallelModel:
    """Model on CPU or meta -> parallelised -> materialised and initialised identically at any world size."""
    from meshforge.distributed.parallelize import parallelize_model

    meta_probe = build_model(cfg.model, device="meta")
    n_params = sum(p.numel() for p in meta_probe.parameters())
    meta = use_meta_init(cfg, mesh_ctx.world_size, n_params)
    if mesh_ctx.pp_size > 1:
        from meshforge.distributed.pipeline import build_pipeline_model

        return build_pipeline_model(cfg, mesh_ctx, device, meta=meta)
    model = meta_probe if meta else build_model(cfg.model)
    if not meta:
        init_weights(model, cfg.run.seed)
        model.to(device)
    model, strategy = parallelize_model(model, mesh_ctx, cfg.distributed, device, compile=cfg.training.compile)
    if meta:
        strategy.materialize(model, cfg.run.seed)
    if cfg.model.init_from:
        from meshforge.checkpoint.hf import load_hf_into

        load_hf_into(strategy.unwrap(model), cfg.model.init_from)
    return ParallelModel(model, strategy, mesh_ctx, device, cfg.training.precision)


class _StopFlag:
    """SIGTERM/SIGUSR1 (what SLURM sends before preemption) ask the loop to save and exit after this step."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, h in self._old.items():
            signal.signal(sig, h)


def train(cfg: Config) -> TrainResult:
    from meshforge.distributed.env import choose_cuda_device_max_connections, env_world_size

    cuda = cfg.training.device != "cpu" and torch.cuda.is_available()
    note = choose_cuda_device_max_connections(cfg.distributed, env_world_size(), cuda)  # before CUDA starts
    if note and int(os.environ.get("RANK", 0)) == 0:
        print(f"meshforge: {note}", flush=True)
    import torch.distributed as dist

    owns_group = not dist.is_initialized()  # a process group the caller made is theirs to destroy
    info = init_distributed(cfg.training.device, cfg.distributed.timeout_minutes)
    try:
        return _train(cfg, info)
    finally:
        if owns_group:
            destroy()


def _train(cfg: Config, info) -> TrainResult:
    problems = config_rules.check(cfg, info.world_size)
    if problems:
        raise ConfigError(problems)
    device = info.device
    mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, device.type)
    seed_everything(cfg.run.seed)

    pm = build_parallel_model(cfg, mesh_ctx, device)
    optimizer = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer, device)
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.training.max_steps)

    t = cfg.training
    args = resolve_model_args(cfg.model)
    source = build_source(cfg.data, t.seq_len, args.vocab_size, cfg.run.seed)
    loader = ShardedBatchLoader(source, t.global_batch_size, t.micro_batch_size, dp_rank=mesh_ctx.dp_rank,
                                dp_size=mesh_ctx.dp_size, seed=cfg.run.seed)

    ckpt = None
    if cfg.checkpoint.interval or cfg.checkpoint.save_final or cfg.checkpoint.resume not in (None, "auto") \
            or cfg.checkpoint.save_consolidated:
        from meshforge.checkpoint.manager import CheckpointManager

        ckpt = CheckpointManager(cfg, mesh_ctx, info)
    elif cfg.checkpoint.resume == "auto":
        from meshforge.checkpoint.manager import CheckpointManager, has_checkpoint

        if has_checkpoint(cfg):
            ckpt = CheckpointManager(cfg, mesh_ctx, info)
    start_step = ckpt.resume(pm, optimizer, scheduler, loader) if ckpt else 0

    log = MetricsLogger(cfg.run.output_dir, cfg.logging, t.max_steps, enabled=info.is_main, start_step=start_step)
    for w in config_rules.warnings(cfg, info.world_size):
        log.info(f"warning: {w}")
    model_ref = pm.unwrapped_parts()[0]
    flops_per_token = model_ref.flops_per_token(t.seq_len) if hasattr(model_ref, "flops_per_token") else 0.0
    peak = device_peak_tflops(device, cfg.logging.peak_tflops)
    tokens_per_step = t.global_batch_size * t.seq_len
    log.info(f"meshforge: {cfg.run.name} | strategy={cfg.distributed.strategy} world={info.world_size} "
             f"layout={dict(zip(('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'), mesh_ctx.layout.shape))} "
             f"device={device} accum={loader.accum_steps} steps {start_step}->{t.max_steps}")

    result = TrainResult(start_step=start_step, parallel_model=pm, optimizer=optimizer)
    stop = _StopFlag()
    stop.install()
    pm.train()
    skipped_in_row = 0
    window_t0, window_tokens = time.perf_counter(), 0
    step = start_step
    try:
        while step < t.max_steps:
            loss = pm.forward_backward(loader.next_batch())
            if "nan_at_step" in os.environ.get("MESHFORGE_FAULT", ""):  # test hook, see checkpoint/faults.py
                from meshforge.checkpoint.faults import inject_nan

                loss = inject_nan(loss, step + 1, pm)
            grad_norm = pm.clip_grad_norm_(t.grad_clip)
            loss_v, gn_v = float(loss), float(grad_norm)
            if not (math.isfinite(loss_v) and math.isfinite(gn_v)):
                if t.nonfinite == "stop":
                    raise TrainingStopped(f"non-finite {'loss' if not math.isfinite(loss_v) else 'grad norm'} at "
                                          f"step {step + 1} (loss={loss_v}, grad_norm={gn_v}); no checkpoint was "
                                          "written for it. Lower optimizer.lr or set training.nonfinite=skip")
                skipped_in_row += 1
                result.skipped_steps += 1
                pm.zero_grad(optimizer)
                log.info(f"warning: step {step + 1} skipped (loss={loss_v}, grad_norm={gn_v}), "
                         f"{skipped_in_row} in a row")
                if skipped_in_row >= t.max_skipped:
                    raise TrainingStopped(f"{skipped_in_row} non-finite steps in a row up to step {step + 1} "
                                          f"(training.max_skipped={t.max_skipped}): stopping")
            else:
                skipped_in_row = 0
                optimizer.step()
                pm.after_optimizer_step()
            scheduler.step()
            pm.zero_grad(optimizer)
            step += 1
            result.losses.append(loss_v)
            result.grad_norms.append(gn_v)
            window_tokens += tokens_per_step

            if step % cfg.logging.log_every == 0 or step == t.max_steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                now = time.perf_counter()
                rec = {"step": step, "loss": loss_v, "grad_norm": gn_v, "lr": scheduler.get_last_lr()[0]}
                tp = throughput(window_tokens, now - window_t0, flops_per_token, info.world_size, peak)
                rec.update(tokens_per_s=tp["tokens_per_s"], tflops=tp["tflops"], mfu=tp["mfu"],
                           max_mem_gib=max_memory_gib(device))
                log.log(rec)
                window_t0, window_tokens = time.perf_counter(), 0

            if ckpt:
                ckpt.maybe_save(step, pm, optimizer, scheduler, loader, final=step == t.max_steps)
            if _stop_requested(stop, mesh_ctx, device):
                result.stopped_by_signal = True
                if ckpt is None:
                    from meshforge.checkpoint.manager import CheckpointManager

                    ckpt = CheckpointManager(cfg, mesh_ctx, info)
                ckpt.save(step, pm, optimizer, scheduler, loader)
                log.info(f"stop signal received: saved step {step} and exiting")
                break
    finally:
        stop.restore()
        if ckpt:
            ckpt.close()
        log.close()
    result.final_step = step
    return result


def _stop_requested(stop: _StopFlag, mesh_ctx: MeshContext, device: torch.device) -> bool:
    """Any rank's signal stops every rank at the same step (SLURM may signal only some)."""
    if mesh_ctx.world_size == 1:
        return stop.requested
    import torch.distributed as dist

    flag = torch.tensor([1.0 if stop.requested else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def write_resolved_config(cfg: Config, path: str | os.PathLike) -> None:
    import yaml

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"dist", "ddp"}), sort_keys=False))
