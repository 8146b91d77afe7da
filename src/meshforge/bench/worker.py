"""One bench configuration inside its own fresh process group (`python -m meshforge.bench.worker SPEC OUT`).

It builds the run exactly as the trainer does (`build_parallel_model`,
`build_optimizer`, `build_scheduler`, `ShardedBatchLoader`) and runs the trainer's
step body: next batch -> `ParallelModel.forward_backward` -> `clip_grad_norm_` ->
`float()` of loss and norm (the trainer's finiteness check, a host sync) ->
`optimizer.step()` -> `after_optimizer_step` -> `scheduler.step()` -> `zero_grad`.

Timing: `warmup` untimed steps, then `steps` timed ones, each bracketed by a device
synchronisation; a step's time is the slowest rank's. After them one more
untimed step counts collective bytes (`measure.CommCounter`) and, before its
`zero_grad`, the bytes of state each rank holds. Rank 0 writes one JSON result.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch


def train_step(pm, optimizer, scheduler, loader, grad_clip, before_zero_grad=None) -> tuple[float, float]:
    """The trainer's step body (training/trainer.py `_train`), without logging and checkpoints."""
    loss = pm.forward_backward(loader.next_batch())
    grad_norm = pm.clip_grad_norm_(grad_clip)
    loss_v, gn_v = float(loss), float(grad_norm)
    optimizer.step()
    pm.after_optimizer_step()
    scheduler.step()
    if before_zero_grad is not None:
        before_zero_grad()
    pm.zero_grad(optimizer)
    return loss_v, gn_v


def _strategy_comm_bytes(strategy) -> int | None:
    """A strategy that counts its own traffic (megatron_fsdp may) exposes `comm_bytes`: an int or a dict."""
    cb = getattr(strategy, "comm_bytes", None)
    if callable(cb):
        cb = cb()
    if isinstance(cb, dict):
        vals = [v for v in cb.values() if isinstance(v, (int, float))]
        return int(cb.get("total", sum(vals))) if vals else None
    return int(cb) if isinstance(cb, (int, float)) else None


def build_run(cfg, info):
    """Everything the trainer builds before its loop, from the trainer's own functions."""
    from meshforge.config import ConfigError
    from meshforge.config import rules as config_rules
    from meshforge.data import ShardedBatchLoader, build_source
    from meshforge.distributed.mesh import MeshContext
    from meshforge.models import resolve_model_args
    from meshforge.training.optim import build_optimizer, build_scheduler
    from meshforge.training.trainer import build_parallel_model, seed_everything

    problems = config_rules.check(cfg, info.world_size)
    if problems:
        raise ConfigError(problems)
    mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, info.device.type)
    seed_everything(cfg.run.seed)
    pm = build_parallel_model(cfg, mesh_ctx, info.device)
    optimizer = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer, info.device)
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.training.max_steps)
    t = cfg.training
    source = build_source(cfg.data, t.seq_len, resolve_model_args(cfg.model).vocab_size, cfg.run.seed)
    loader = ShardedBatchLoader(source, t.global_batch_size, t.micro_batch_size, dp_rank=mesh_ctx.dp_rank,
                                dp_size=mesh_ctx.dp_size, seed=cfg.run.seed)
    pm.train()
    return mesh_ctx, pm, optimizer, scheduler, loader


def measure(cfg, info, steps: int, warmup: int, peak_override: float | None = None) -> dict:
    from meshforge.bench.measure import CommCounter, state_bytes, step_stats, sync, throughput_fields
    from meshforge.training.metrics import device_peak_tflops

    device = info.device
    mesh_ctx, pm, optimizer, scheduler, loader = build_run(cfg, info)
    t = cfg.training
    dist_on = info.world_size > 1
    if dist_on:
        import torch.distributed as dist

    for _ in range(warmup):
        train_step(pm, optimizer, scheduler, loader, t.grad_clip)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if dist_on:
        dist.barrier()
    times, losses = [], []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        loss_v, _ = train_step(pm, optimizer, scheduler, loader, t.grad_clip)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss_v)
    cuda_mem = None
    if device.type == "cuda":
        cuda_mem = {"max_allocated": torch.cuda.max_memory_allocated(device),
                    "max_reserved": torch.cuda.max_memory_reserved(device)}

    # one more step, untimed: collective bytes and the state this rank holds before zero_grad
    held: dict = {}
    before = _strategy_comm_bytes(pm.strategy)
    counter = CommCounter()
    with counter:
        train_step(pm, optimizer, scheduler, loader, t.grad_clip,
                   before_zero_grad=lambda: held.update(state_bytes(pm.parts, optimizer, pm.strategy)))
    after = _strategy_comm_bytes(pm.strategy)
    comm = counter.summary()
    comm["source"] = "dispatch"
    if before is not None and after is not None and after >= before:
        comm.update(total=after - before, source="strategy.comm_bytes", dispatch_total=counter.total)

    if dist_on:  # the slowest rank sets each step's time
        tt = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        times = tt.tolist()
        ranks: list = [None] * info.world_size
        dist.all_gather_object(ranks, {"rank": info.rank, "state_bytes": held, "cuda_memory": cuda_mem,
                                       "comm_bytes_per_step": comm["total"]})
    else:
        ranks = [{"rank": 0, "state_bytes": held, "cuda_memory": cuda_mem, "comm_bytes_per_step": comm["total"]}]

    model_ref = pm.unwrapped_parts()[0]
    fpt = model_ref.flops_per_token(t.seq_len) if hasattr(model_ref, "flops_per_token") else 0.0
    peak = device_peak_tflops(device, peak_override or cfg.logging.peak_tflops)
    stats = step_stats(times)
    tokens_per_step = t.global_batch_size * t.seq_len
    return {
        "world_size": info.world_size, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(), "strategy": cfg.distributed.strategy,
        "layout": dict(zip(("pp", "dp_replicate", "dp_shard", "cp", "tp"), mesh_ctx.layout.shape)),
        "precision": t.precision, "seq_len": t.seq_len, "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size, "accum_steps": loader.accum_steps,
        "tokens_per_step": tokens_per_step, "flops_per_token": fpt,
        "n_params": sum(p.numel() for p in model_ref.parameters()),
        "steps": steps, "warmup": warmup, "losses": losses,
        **stats, **throughput_fields(stats["step_s_median"], tokens_per_step, info.world_size, fpt, peak),
        "comm": comm, "comm_bytes_per_step": comm["total"],
        "per_rank": ranks,
        "state_bytes_max": max(r["state_bytes"].get("total", 0) for r in ranks),
        "cuda_max_allocated_max": max((r["cuda_memory"] or {}).get("max_allocated", 0) for r in ranks) or None,
        "cuda_max_reserved_max": max((r["cuda_memory"] or {}).get("max_reserved", 0) for r in ranks) or None,
    }


def main(spec_path: str, out_path: str) -> int:
    from meshforge.config import load_config
    from meshforge.distributed.env import destroy, env_world_size, init_distributed

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(spec.get("config"), spec["overrides"], world_size=env_world_size())
        info = init_distributed(cfg.training.device, cfg.distributed.timeout_minutes)
        try:
            result = measure(cfg, info, spec["steps"], spec["warmup"], spec.get("peak_tflops"))
        finally:
            destroy()
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
        return 0
    except Exception as err:  # noqa: BLE001 - reported by the runner as this configuration's failure
        problems = getattr(err, "problems", None)
        msg = "; ".join(problems) if problems else f"{type(err).__name__}: {err}"
        Path(f"{out_path}.rank{rank}.err").write_text(json.dumps({"error": msg, "traceback": traceback.format_exc()}))
        print(f"error: rank {rank}: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
