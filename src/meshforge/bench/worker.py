"""One bench configuration inside its own fresh process group (launch target `meshforge.bench.worker:run`).

It builds the run with `Trainer.build`, exactly as training does, and times `Trainer.train_step`, the
training loop's own step (which never reads the loss back; the bench synchronises the device around each
timed step instead). Each timed step also records how long it waited for its batch (`data_wait_s_*`: the
loader's time in the step, the slowest rank's), to set against the step time.

Timing: `warmup` untimed steps, then `steps` timed ones, each bracketed by a device
synchronisation; a step's time is the slowest rank's. On CPU each step's busy time is recorded too
(`step_busy_s_*`: the process CPU time of the step, the slowest rank's): a CPU core is the device, and on a shared
machine the wall time also holds the time other jobs had the cores, which the busy time does not. After them one more
untimed step counts collective bytes (`measure.CommCounter`) and, before its
`zero_grad`, the bytes of state each rank holds; on CPU it also times its kernels by kind
(`step_kernels_s`, rank 0's). Rank 0 returns the result.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from meshforge.bench.device_profile import BlockProbe, Clock, KernelTimer, _cpu_s, profile_device
from meshforge.bench.measure import CommCounter, state_bytes, step_stats, sync, throughput_fields
from meshforge.config import load_config
from meshforge.distributed.env import destroy, env_world_size, init_distributed
from meshforge.models import contract_of, resolve_model_args
from meshforge.training.metrics import device_peak_tflops
from meshforge.training.trainer import Trainer


def _comm_total(strategy) -> int | None:
    cb = strategy.comm_bytes_total()
    return None if cb is None else int(cb)


class _Timed:
    """One configuration under measurement: its trainer and what its timed steps recorded."""

    def __init__(self, cfg, info):
        self.cfg, self.info = cfg, info
        self.trainer = Trainer.build(cfg, info)
        self.times: list[float] = []
        self.waits: list[float] = []
        self.busy: list[float] = []
        self.losses: list = []

    def step(self) -> None:
        """One timed step (bracketed by device synchronisation)."""
        marks: dict = {}
        device = self.info.device
        sync(device)
        t0, c0 = time.perf_counter(), _cpu_s()
        loss, _ = self.trainer.train_step(lambda part: marks.setdefault(part, time.perf_counter()))
        sync(device)
        self.times.append(time.perf_counter() - t0)
        self.busy.append(_cpu_s() - c0)
        self.waits.append(marks["data"] - t0)  # the step waited this long for its batch (data.num_workers hides it)
        self.losses.append(loss)


def measure(cfg, info, steps: int, warmup: int, peak_override: float | None = None, profile: bool = False) -> dict:
    """One configuration: `warmup` untimed steps, `steps` timed ones, then the counting step (module docstring)."""
    one = _Timed(cfg, info)
    for _ in range(warmup):
        one.trainer.train_step()
    _start_timing(info)
    for _ in range(steps):
        one.step()
    return _result(one, steps, warmup, peak_override, profile)


def measure_interleaved(cfgs: list, info, steps: int, warmup: int, peak_override: float | None = None,
                        profile: bool = False) -> list[dict]:
    """Several configurations of one world size in this process group, built side by side and stepped in turn
    (round r times step r of each), so that a machine whose load changes affects them alike; then each one's
    counting step. All their trainers are alive at once (their memory adds up). With `profile`, each round also
    runs the device profile's block probe and one untimed step of the first configuration under a kernel timer
    (on CPU: its time in kernels by kind, the median over rounds, is what `plan --calibrate` splits its busy time
    with)."""
    runs = [_Timed(cfg, info) for cfg in cfgs]
    probe = BlockProbe(cfgs[0], resolve_model_args(cfgs[0].model), info.device) if profile else None
    probe_s = []
    for _ in range(warmup):
        for one in runs:
            one.trainer.train_step()
    _start_timing(info)
    kernels = []
    for _ in range(steps):
        for one in runs:
            one.step()
        if probe is not None:  # the profile's reference workload, and the first configuration's kernels, under
            probe_s.append(probe.seconds())  # this round's load
            timer = KernelTimer(Clock(info.device))
            with timer:
                runs[0].trainer.train_step()
            kernels.append(timer.s)
    rows = [_result(one, steps, warmup, peak_override, (probe, probe_s) if profile and i == 0 else None)
            for i, one in enumerate(runs)]
    if kernels:  # per kind, the median over the rounds: beside the median busy time of the same rounds
        rows[0]["step_kernels_s"] = {k: statistics.median(t[k] for t in kernels) for k in kernels[0]}
    return rows


def _start_timing(info) -> None:
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)
    if info.world_size > 1:
        dist.barrier()


def _result(one: _Timed, steps: int, warmup: int, peak_override: float | None, profile) -> dict:
    """One configuration's row; `profile`: measure the device too (True, or (probe, its seconds per round))."""
    cfg, info, trainer = one.cfg, one.info, one.trainer
    device = info.device
    mesh_ctx, pm, optimizer, loader = trainer.mesh_ctx, trainer.pm, trainer.optimizer, trainer.loader
    t = cfg.training
    dist_on = info.world_size > 1
    times, waits, busy = one.times, one.waits, one.busy
    losses = torch.stack(one.losses).tolist() if one.losses else []
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

    # on CPU also its kernels' time by kind (the timer entered first, so the counter's own work is outside what it
    # times): what `meshforge plan --calibrate` splits the busy time into kernels and host time with
    timer = KernelTimer(Clock(device)) if device.type == "cpu" else None
    with timer or contextlib.nullcontext(), counter:
        trainer.train_step(clock)
    after = _comm_total(pm.strategy)
    comm = counter.summary()
    comm["source"] = "dispatch"
    if before is not None and after is not None and after >= before:
        comm.update(total=after - before, source="strategy.comm_bytes", dispatch_total=counter.total)

    if dist_on:  # the slowest rank sets each step's time
        tt = torch.tensor([times, waits, busy], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)
        times, waits, busy = tt.tolist()
        ranks: list = [None] * info.world_size
        dist.all_gather_object(ranks, {"rank": info.rank, "state_bytes": held, "cuda_memory": cuda_mem,
                                       "comm_bytes_per_step": comm["total"]})
    else:
        ranks = [{"rank": 0, "state_bytes": held, "cuda_memory": cuda_mem, "comm_bytes_per_step": comm["total"]}]

    model_ref = pm.unwrapped_parts()[0]
    fpt = contract_of(model_ref).flops_per_token(t.seq_len)
    peak = device_peak_tflops(device, peak_override or cfg.logging.peak_tflops)
    stats = step_stats(times)
    if device.type == "cpu":
        stats.update({k.replace("step_s", "step_busy_s"): v for k, v in step_stats(busy).items()})
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
        **({"step_kernels_s": timer.s} if timer else {}),
        **({"device_profile": profile_device(cfg, info, *(profile if isinstance(profile, tuple) else ()))}
           if profile else {}),
    }


def run(spec: dict) -> dict:
    """Launch target: measure one configuration; every rank returns the same result."""
    cfg = load_config(spec.get("config"), spec["overrides"], world_size=env_world_size())
    info = init_distributed(cfg.training.device, cfg.distributed.timeout_minutes)
    try:
        return measure(cfg, info, spec["steps"], spec["warmup"], spec.get("peak_tflops"), spec.get("profile", False))
    finally:
        destroy()


def run_interleaved(spec: dict) -> list[dict]:
    """Launch target: measure several configurations of one world size, interleaved (`measure_interleaved`)."""
    cfgs = [load_config(spec.get("config"), o, world_size=env_world_size()) for o in spec["overrides"]]
    info = init_distributed(cfgs[0].training.device, cfgs[0].distributed.timeout_minutes)
    try:
        return measure_interleaved(cfgs, info, spec["steps"], spec["warmup"], spec.get("peak_tflops"),
                                   spec.get("profile", False))
    finally:
        destroy()
