"""One bench configuration inside its own fresh process group (launch target `meshforge.bench.worker:run`).

It builds the run with `Trainer.build`, exactly as training does, and times `Trainer.train_step`, the
training loop's own step (which never reads the loss back; the bench synchronises the device around each
timed step instead). Each timed step also records how long it waited for its batch (`data_wait_s_*`: the
loader's time in the step, the slowest rank's), to set against the step time.

Timing: `warmup` untimed steps, then `steps` timed ones, each bracketed by a device
synchronisation; a step's time is the slowest rank's. After them one more
untimed step counts collective bytes (`measure.CommCounter`) and, before its
`zero_grad`, the bytes of state each rank holds. Rank 0 returns the result.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from meshforge.bench.measure import CommCounter, state_bytes, step_stats, sync, throughput_fields
from meshforge.config import load_config
from meshforge.distributed.env import destroy, env_world_size, init_distributed
from meshforge.models import contract_of
from meshforge.training.metrics import device_peak_tflops
from meshforge.training.trainer import Trainer


def _comm_total(strategy) -> int | None:
    cb = strategy.comm_bytes_total()
    return None if cb is None else int(cb)


def measure(cfg, info, steps: int, warmup: int, peak_override: float | None = None) -> dict:
    device = info.device
    trainer = Trainer.build(cfg, info)
    mesh_ctx, pm, optimizer, loader = trainer.mesh_ctx, trainer.pm, trainer.optimizer, trainer.loader
    t = cfg.training
    dist_on = info.world_size > 1
    for _ in range(warmup):
        trainer.train_step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if dist_on:
        dist.barrier()
    times, waits, losses = [], [], []
    marks: dict = {}

    def mark(part: str) -> None:
        marks.setdefault(part, time.perf_counter())

    for _ in range(steps):
        sync(device)
        marks.clear()
        t0 = time.perf_counter()
        loss, _ = trainer.train_step(mark)
        sync(device)
        times.append(time.perf_counter() - t0)
        waits.append(marks["data"] - t0)  # the step waited this long for its batch (data.num_workers hides it)
        losses.append(loss)
    losses = torch.stack(losses).tolist() if losses else []
    cuda_mem = None
    if device.type == "cuda":
        cuda_mem = {"max_allocated": torch.cuda.max_memory_allocated(device),
                    "max_reserved": torch.cuda.max_memory_reserved(device)}

    # one more step, untimed: collective bytes and the state this rank holds before zero_grad
    held: dict = {}
    before = _comm_total(pm.strategy)
    counter = CommCounter()

    def clock(part: str) -> None:  # the state this rank holds after the update, before zero_grad
        if part == "schedule":
            held.update(state_bytes(pm.parts, optimizer, pm.strategy))

    with counter:
        trainer.train_step(clock)
    after = _comm_total(pm.strategy)
    comm = counter.summary()
    comm["source"] = "dispatch"
    if before is not None and after is not None and after >= before:
        comm.update(total=after - before, source="strategy.comm_bytes", dispatch_total=counter.total)

    if dist_on:  # the slowest rank sets each step's time
        tt = torch.tensor([times, waits], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        times, waits = tt.tolist()
        ranks: list = [None] * info.world_size
        dist.all_gather_object(ranks, {"rank": info.rank, "state_bytes": held, "cuda_memory": cuda_mem,
                                       "comm_bytes_per_step": comm["total"]})
    else:
        ranks = [{"rank": 0, "state_bytes": held, "cuda_memory": cuda_mem, "comm_bytes_per_step": comm["total"]}]

    model_ref = pm.unwrapped_parts()[0]
    fpt = contract_of(model_ref).flops_per_token(t.seq_len)
    peak = device_peak_tflops(device, peak_override or cfg.logging.peak_tflops)
    stats = step_stats(times)
    tokens_per_step = t.global_batch_size * t.seq_len
    return {
        "world_size": info.world_size, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(), "strategy": cfg.distributed.strategy,
        "layout": mesh_ctx.layout.named_shape(),
        "precision": t.precision, "seq_len": t.seq_len, "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size, "accum_steps": loader.accum_steps,
        "tokens_per_step": tokens_per_step, "flops_per_token": fpt,
        "n_params": sum(p.numel() for p in model_ref.parameters()),
        "steps": steps, "warmup": warmup, "losses": losses,
        **stats, "data_wait_s_median": statistics.median(waits), "data_wait_s_mean": statistics.mean(waits),
        "data_wait_s_all": waits,
        **throughput_fields(stats["step_s_median"], tokens_per_step, info.world_size, fpt, peak),
        "comm": comm, "comm_bytes_per_step": comm["total"],
        "per_rank": ranks,
        "state_bytes_max": max(r["state_bytes"].get("total", 0) for r in ranks),
        "cuda_max_allocated_max": max((r["cuda_memory"] or {}).get("max_allocated", 0) for r in ranks) or None,
        "cuda_max_reserved_max": max((r["cuda_memory"] or {}).get("max_reserved", 0) for r in ranks) or None,
    }


def run(spec: dict) -> dict:
    """Launch target: measure one configuration; every rank returns the same result."""
    cfg = load_config(spec.get("config"), spec["overrides"], world_size=env_world_size())
    info = init_distributed(cfg.training.device, cfg.distributed.timeout_minutes)
    try:
        return measure(cfg, info, spec["steps"], spec["warmup"], spec.get("peak_tflops"))
    finally:
        destroy()
