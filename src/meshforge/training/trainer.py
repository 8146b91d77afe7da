"""The training loop: `Trainer.build(cfg, info)` makes everything a run needs, `fit()` runs it.

Read top to bottom:
  build()       rules -> MeshContext -> parallel model (+ Hugging Face weights) -> optimizer, schedule -> data
  train_step()  one optimizer step, and no host synchronisation: batch -> forward/backward -> clip ->
                the non-finite policy arms the optimizer on the device -> update -> schedule -> zero_grad
  fit()         resume -> steps; on log steps (and before a save) read the losses back, let the non-finite
                policy judge them, log; save; stop when any rank was signalled
The loop's parts live in their own modules: `nonfinite.py` (skip/stop), `signals.py` (preemption),
`checkpoint/manager.py` (save, resume; what it saves is `checkpoint_parts()`, built by `checkpoint/parts.py`),
`logger.py`. Tests arm faults through the same hooks (`after_backward`, `after_step`, `before_commit`,
`before_write`; see `faults.py`). The trainer never branches on a strategy's name: strategies and parallelisms
plug in through `ParallelModel` and the `Strategy` protocol.
The bench and the tests build runs with `Trainer.build` too, so what they measure is this loop's step.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from meshforge.checkpoint.hf import PlainInitFrom, load_hf_into
from meshforge.checkpoint.manager import CheckpointManager
from meshforge.checkpoint.parts import training_parts
from meshforge.checkpoint.paths import has_checkpoint
from meshforge.checkpoint.peft import load_peft_adapter
from meshforge.config import rules as config_rules
from meshforge.config.schema import Config
from meshforge.data import ShardedBatchLoader, background, batch_loader, build_source
from meshforge.data.sources import split_validation
from meshforge.distributed import hang
from meshforge.distributed.build import build_parallel_model
from meshforge.distributed.env import (
    DistInfo,
    apply_slurm_env,
    choose_cuda_device_max_connections,
    destroy,
    env_world_size,
    init_distributed,
)
from meshforge.distributed.mesh import MeshContext
from meshforge.distributed.runtime import ParallelModel
from meshforge.errors import ConfigError
from meshforge.launch import restart_attempt
from meshforge.models import contract_of, resolve_model_args
from meshforge.training import faults, rundir
from meshforge.training.logger import MetricsLogger
from meshforge.training.metrics import device_peak_tflops, max_memory_gib, throughput
from meshforge.training.nonfinite import NonFinitePolicy
from meshforge.training.optim import build_optimizer, build_scheduler
from meshforge.training.profiling import StepProfiler
from meshforge.training.evaluation import Evaluation
from meshforge.training.samples import Samples
from meshforge.training.signals import StopSignal
from meshforge.training.stragglers import StepClock
from meshforge.training.validation import Validation


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # one per step run in this process, in order
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    skipped_steps: int = 0
    validations: list[dict] = field(default_factory=list)  # {step, val_loss, val_ppl} per validation run
    samples: list[dict] = field(default_factory=list)  # {step, samples: [{prompt, completion}]} (logging.samples)
    evaluations: list[dict] = field(default_factory=list)  # {step, eval/...} (training.eval_every)
    stopped_by_signal: bool = False
    signal: str | None = None  # the signal that stopped the run ("SIGTERM", "SIGINT", ...)
    parallel_model: ParallelModel | None = None
    optimizer: torch.optim.Optimizer | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, info: DistInfo, mesh_ctx: MeshContext, pm: ParallelModel,
                 optimizer: torch.optim.Optimizer, scheduler, loader: ShardedBatchLoader):
        self.cfg, self.info, self.mesh_ctx, self.pm = cfg, info, mesh_ctx, pm
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.step = 0  # optimizer steps done
        self.nonfinite = NonFinitePolicy(cfg.training.nonfinite, cfg.training.max_skipped, optimizer, info.device)
        self.after_backward: list[Callable[[int, torch.Tensor], torch.Tensor]] = []  # (step, loss) -> loss
        self.after_step: list[Callable[[int], None]] = []  # (step) -> None
        self.before_commit: Callable[[int], None] | None = None  # handed to the checkpoint manager
        self.before_write: Callable[[int, Path], None] | None = None  # the same
        self.validation: Validation | None = None  # set by build() when training.val_every > 0
        self.samples: Samples | None = None  # set by build() with logging.samples
        self.evaluation: Evaluation | None = None  # set by build() with training.eval
        self.data_notes: list[str] = []  # set by build(): lines on data left out, logged at start
        faults.install(self)

    @classmethod
    def build(cls, cfg: Config, info: DistInfo) -> Trainer:
        """Everything a run holds before its first step, the same for training, the bench and the tests."""
        problems = config_rules.check(cfg, info.world_size)
        if problems:
            raise ConfigError(problems)
        mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, info.device.type)
        seed_everything(cfg.run.seed)
        early = PlainInitFrom.of(cfg)  # megatron_fsdp: init_from loads before the flat buffers exist
        pm = build_parallel_model(cfg, mesh_ctx, info.device, load_plain=early)
        if cfg.model.init_from and not (early and early.done):
            for part in pm.unwrapped_parts():
                load_hf_into(part, cfg.model.init_from)
        if cfg.peft is not None and cfg.peft.init_from:  # continue training from a PEFT adapter folder
            for part in pm.unwrapped_parts():
                load_peft_adapter(part, cfg.peft)
        optimizer = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer)
        scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.training.max_steps)
        t = cfg.training
        vocab = resolve_model_args(cfg.model).vocab_size
        source, val_source = split_validation(cfg.data, build_source(cfg.data, t.seq_len, vocab, cfg.run.seed),
                                              t.seq_len, vocab, cfg.run.seed)
        loader = background(batch_loader(source, t.global_batch_size, t.micro_batch_size, mesh_ctx.dp_rank,
                                         mesh_ctx.dp_size, cfg.run.seed, cfg.checkpoint.allow_changed_inputs),
                            cfg.data)  # data.num_workers: batches built ahead in worker processes
        pm.train()
        trainer = cls(cfg, info, mesh_ctx, pm, optimizer, scheduler, loader)
        trainer.validation = Validation.build(cfg, mesh_ctx, pm, val_source)
        trainer.samples = Samples.build(cfg, pm)
        trainer.evaluation = Evaluation.build(cfg, pm)
        # what of the data did not reach training as written (SFT examples dropped, truncated, left out)
        reports = [getattr(s, "report", None) for s in (source, val_source) if s is not None]
        trainer.data_notes = [f"{'validation ' if i else ''}{r}" for i, r in enumerate(reports) if r
                              and r not in reports[:i]]
        if cfg.data.mix:  # the weights, and the shares the schedule gives the whole run
            run = (loader.loader if hasattr(loader, "loader") else loader).realised(t.max_steps)
            trainer.data_notes.append("data mix: " + ", ".join(
                f"{n} weight {w:.4f} realised {run[n]:.4f}" for n, w in source.shares().items()) +
                f" (samples of the {t.max_steps * t.global_batch_size} this run trains on)")
        return trainer

    # ------------------------------------------------------------------ one step
    def train_step(self, clock: Callable[[str], None] | None = None,
                   batch: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss, grad norm) as device tensors, never read here.
        `clock(part)` (the bench's breakdown) is called after each part of the step; `batch` (this rank's
        micro batches) replaces the loader's next batch."""
        tick = clock or (lambda _part: None)
        batch = self.loader.next_batch() if batch is None else batch
        tick("data")
        loss = self.pm.forward_backward(batch)
        for hook in self.after_backward:
            loss = hook(self.step + 1, loss)
        tick("forward_backward")
        grad_norm = self.pm.clip_grad_norm_(self.cfg.training.grad_clip)
        tick("clip")
        if self.nonfinite.apply(loss, grad_norm):
            self.optimizer.step()
            self.pm.after_optimizer_step()
        tick("optimizer")
        self.scheduler.step()
        tick("schedule")
        self.pm.zero_grad(self.optimizer)
        tick("zero_grad")
        self.step += 1
        return loss, grad_norm

    # ------------------------------------------------------------------ the run
    def checkpoint_parts(self) -> dict[str, Stateful]:
        """What a checkpoint of this run holds, each part saving and loading itself (checkpoint/parts.py)."""
        return training_parts(self.cfg, self.pm, self.optimizer, self.scheduler, self.loader)

    def checkpoints(self) -> CheckpointManager:
        """A checkpoint manager of this run's parts, with the fault hook (`before_commit`) armed."""
        ckpt = CheckpointManager(self.cfg, self.mesh_ctx, self.info, self.checkpoint_parts())
        ckpt.before_commit, ckpt.before_write = self.before_commit, self.before_write
        return ckpt

    def _open_checkpoints(self) -> CheckpointManager | None:
        c = self.cfg.checkpoint
        wanted = rundir.writes_checkpoints(self.cfg) or c.resume not in (None, "auto")
        if not (wanted or (c.resume == "auto" and has_checkpoint(self.cfg))):
            return None
        return self.checkpoints()

    def fit(self) -> TrainResult:
        run_dir = rundir.claim(self.cfg, self.info)  # lock, writability, never overwrite a run unasked
        try:
            return self._fit(run_dir)
        finally:
            run_dir.release()

    def _fit(self, run_dir: rundir.RunDir) -> TrainResult:
        cfg, t, info = self.cfg, self.cfg.training, self.info
        ckpt = self._open_checkpoints()
        if ckpt is not None:
            self.step = ckpt.resume()
        run_dir.begin(self.step, ckpt.resumed_from if ckpt is not None else None)  # a step-0 start is a fresh run
        result = TrainResult(start_step=self.step, parallel_model=self.pm, optimizer=self.optimizer)
        profiler = StepProfiler(cfg.profiling, cfg.run.output_dir, info.rank, info.device, note=lambda m: log.info(m))
        log = MetricsLogger(cfg.run.output_dir, cfg.logging, t.max_steps, enabled=info.is_main,
                            start_step=self.step, run_name=cfg.run.name)
        log.start(cfg, world_size=info.world_size, layout=self.mesh_ctx.layout.named_shape(), device=str(info.device))
        for w in config_rules.warnings(cfg, info.world_size):
            log.info(f"warning: {w}")
        restarts, cause = restart_attempt()
        if restarts:
            log.info(f"meshforge: restart {restarts} (after: {cause or 'a failure its launcher did not name'}): "
                     f"resumed at step {self.step}")
        for note in [*self.data_notes, self.loader.resume_note]:  # (resume_note: resumed onto changed data)
            if note:
                log.info(note)
        log.info(f"meshforge: {cfg.run.name} | strategy={cfg.distributed.strategy} world={info.world_size} "
                 f"layout={self.mesh_ctx.layout.named_shape()} device={info.device} "
                 f"accum={self.loader.accum_steps} steps {self.step}->{t.max_steps}")
        clock = StepClock(info, cfg.logging.straggler_ratio)  # each rank's own time per step (stragglers.py)
        metrics, window = _Throughput(self, log, clock), _Window(self.nonfinite, result, log)
        signals = StopSignal(info.world_size)
        signals.install()
        try:
            while self.step < t.max_steps:
                with profiler.step(self.step + 1):
                    clock.start()
                    window.add(self.step + 1, *self.train_step(clock.tick))
                    clock.stop()
                for hook in self.after_step:
                    hook(self.step)
                final = self.step == t.max_steps
                log_now = self.step % cfg.logging.log_every == 0 or final
                save = ckpt is not None and ckpt.will_save(self.step, final)
                if log_now or save:
                    window.read()  # before a save too: nothing is saved for a step the non-finite policy stops at
                if log_now:
                    metrics.log(result)
                if self.validation is not None and self.validation.due(self.step):
                    metrics.t0 += self.validation(self.step, result, log)
                if self.samples is not None and self.samples.due(self.step):
                    metrics.t0 += self.samples(self.step, result, log)
                if self.evaluation is not None and self.evaluation.due(self.step):
                    metrics.t0 += self.evaluation(self.step, result, log)
                if save:
                    ckpt.maybe_save(self.step, final=final)
                if signals.poll():
                    window.read()
                    result.stopped_by_signal, result.signal = True, signals.received
                    ckpt = ckpt or self.checkpoints()
                    ckpt.save(self.step)
                    log.info(f"stop signal received: saved step {self.step} and exiting ({signals.received})")
                    break
        except RuntimeError as err:
            hang.timed_out(err)  # a collective that timed out: its summary and exit 5, before any teardown waits
            raise
        finally:
            signals.close()
            self.loader.close()  # stops background data workers, if any
            profiler.close()
            if ckpt is not None:
                ckpt.close()
            log.close()
        result.final_step = self.step
        return result


class _Window:
    """The losses and grad norms of the steps since the last read, kept on the device until `read`: then one
    transfer, into the result, and the non-finite policy's verdict on them (warnings, or TrainingStopped)."""

    def __init__(self, nonfinite: NonFinitePolicy, result: TrainResult, log: MetricsLogger):
        self.nonfinite, self.result, self.log = nonfinite, result, log
        self.first_step, self.pairs = 0, []

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if not self.pairs:
            self.first_step = step
        self.pairs.append(torch.stack([loss.detach().float(), grad_norm.detach().float()]))

    def read(self) -> None:
        if not self.pairs:
            return
        values = torch.stack(self.pairs).tolist()
        self.pairs = []
        losses, norms = [v[0] for v in values], [v[1] for v in values]
        self.result.losses += losses
        self.result.grad_norms += norms
        try:
            notes = self.nonfinite.review(self.first_step, losses, norms)
        finally:
            self.result.skipped_steps = self.nonfinite.skipped
        for note in notes:
            self.log.info(note)


class _Throughput:
    """tokens/s, TFLOP/s, MFU, memory and stragglers over the steps since the last log line (the only host sync)."""

    def __init__(self, trainer: Trainer, log: MetricsLogger, clock: StepClock):
        t = trainer.cfg.training
        self.trainer, self.logger, self.clock = trainer, log, clock
        self.flops_per_token = contract_of(trainer.pm.unwrapped_parts()[0]).flops_per_token(t.seq_len)
        self.peak = device_peak_tflops(trainer.info.device, trainer.cfg.logging.peak_tflops)
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.t0, self.step0 = time.perf_counter(), trainer.step
        self.restarts, self.cause = restart_attempt()
        self.mix = getattr(trainer.loader, "loader", trainer.loader) if trainer.cfg.data.mix else None

    def log(self, result: TrainResult) -> None:
        tr = self.trainer
        if tr.info.device.type == "cuda":
            torch.cuda.synchronize(tr.info.device)
        now = time.perf_counter()
        rec = {"step": tr.step, "loss": result.losses[-1], "grad_norm": result.grad_norms[-1],
               "lr": tr.scheduler.get_last_lr()[0]}
        tp = throughput((tr.step - self.step0) * self.tokens_per_step, now - self.t0, self.flops_per_token,
                        tr.info.world_size, self.peak)
        rec.update(tokens_per_s=tp["tokens_per_s"], tflops=tp["tflops"], mfu=tp["mfu"],
                   max_mem_gib=max_memory_gib(tr.info.device))
        stragglers, warning = self.clock.report(self.step0 + 1, tr.step)  # the one collective of a log step
        rec.update(stragglers)
        if self.restarts:  # every record of a restarted attempt; the cause on its first
            rec["restarts"] = self.restarts
            if self.cause is not None:
                rec["restart_cause"], self.cause = self.cause, None
        if self.mix is not None:  # data.mix: each source's share of the samples trained on so far
            rec.update({f"mix/{n}": v for n, v in self.mix.realised(tr.step).items()})
        self.logger.log(rec)
        if warning:
            self.logger.info(warning)
        self.t0, self.step0 = time.perf_counter(), tr.step


def train(cfg: Config, info: DistInfo | None = None) -> TrainResult:
    """Train from a validated Config. Without `info`, joins torchrun/SLURM (or runs one process) and tears
    down the process group it made; a group the caller made is theirs to destroy."""
    if info is not None:
        return Trainer.build(cfg, info).fit()
    apply_slurm_env()  # under srun: RANK before it is read below
    cuda = cfg.training.device != "cpu" and torch.cuda.is_available()
    note = choose_cuda_device_max_connections(cfg.distributed, env_world_size(), cuda)  # before CUDA starts
    if note and int(os.environ.get("RANK", 0)) == 0:
        print(f"meshforge: {note}", flush=True)
    owns_group = not dist.is_initialized()
    if not cuda and owns_group:  # the record a hang summary reads (distributed/hang.py), before the group starts
        hang.enable_flight_recorder()
    if cuda and owns_group and env_world_size() > 1:  # NCCL reads these when its process group starts
        where = hang.enable_nccl_flight_recorder(cfg.run.output_dir)
        if where and int(os.environ.get("RANK", 0)) == 0:
            print(f"meshforge: NCCL flight recorder on: a collective that hangs dumps each rank's trace to "
                  f"{where}<rank>", flush=True)
    info = init_distributed(cfg.training.device, cfg.distributed.timeout_minutes)
    try:
        trainer = Trainer.build(cfg, info)
        if owns_group:  # the summary of a hung collective (cli.run_training prints it)
            hang.install(trainer.mesh_ctx, info.rank, lambda: trainer.step + 1, cfg.distributed.timeout_minutes)
        return trainer.fit()
    finally:
        hang.uninstall()
        if owns_group:
            destroy()
