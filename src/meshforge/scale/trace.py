"""Trace one rank of an N-rank job: build it in a fake world, run one real training step, measure it.

`trace_rank(cfg, world_size, rank)` returns a `RankTrace`: the peak memory of the step by category (`StepMemory`,
torch's MemTracker), the state the rank holds after the update (the bench's `state_bytes`: parameters,
gradients, optimizer state), every collective per (mesh axis, kind) in the bench's full-buffer bytes
(`CommRecorder`), and what the trace itself cost (wall and CPU seconds, the process's peak RSS while tracing).

The step is `Trainer.train_step` after one warm-up update (`rank.warm_optimizer`), so the optimizer state is
there from the start as in every step but the first.

Micro batches that repeat are folded (`fold=True`, without pipeline parallelism): micro batches 1 .. n-2 of a
step start from the same live tensors (parameters, the gradients accumulated so far, the same shapes) and run the
same ops, so the trace runs micro batches 0, 1 and n-1 and counts micro batch 1's collectives n-2 times; the peak
of those three is the step's. The CI test checks a folded trace against the unfolded one. A pipeline step is
traced whole (its schedule interleaves the micro batches).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshforge.planning.layout import Layout

FOLDED = 3  # micro batches a folded step runs: the first, one in the middle, the last


@dataclass
class RankTrace:
    rank: int
    world_size: int
    layout: Layout
    peak: dict[str, int]  # {category: bytes at the peak, "total"}
    state: dict[str, int]  # params, grads, optimizer (bytes held after the update)
    comm: dict[tuple[str, str], int]  # {(mesh axis, kind): bytes per step}
    microbatches: int  # micro batches of the step (schedule micro batches under PP)
    microbatches_run: int
    build_s: float
    step_s: float
    cpu_s: float  # CPU seconds of the whole trace (build, warm-up, step)
    rss_bytes: int  # peak resident memory of the process while tracing (0 where unknown)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict, layout: Layout) -> RankTrace:
        """The inverse of `to_dict` (what the worker process prints), with the layout of the traced config."""
        return cls(d["rank"], d["world_size"], layout, d["peak"], d["state"],
                   {(c["axis"], c["kind"]): c["bytes"] for c in d["comm"]}, d["microbatches"], d["microbatches_run"],
                   d["build_s"], d["step_s"], d["cpu_s"], d["rss_bytes"], d.get("notes", []))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "peak": self.peak, "state": self.state,
                "comm": [{"axis": a, "kind": k, "bytes": b} for (a, k), b in sorted(self.comm.items())],
                "microbatches": self.microbatches, "microbatches_run": self.microbatches_run,
                "build_s": self.build_s, "step_s": self.step_s, "cpu_s": self.cpu_s, "rss_bytes": self.rss_bytes,
                "notes": self.notes}


def layout_of(cfg, world_size: int) -> Layout:
    d = cfg.distributed
    return Layout.from_sizes(world_size, tp=d.tp_size, pp=d.pp_size, cp=d.cp_size, ep=d.ep_size, dp=d.dp_size,
                             dp_replicate=d.dp_replicate_size)


def traced_config(cfg):
    """The config the trace builds: the same run, on the meta path (its parameters are materialised fake), compiled
    blocks with aot_eager (the graphs inductor would get, run by eager kernels: no code generation on fake
    tensors). Returns (config, notes)."""
    from meshforge.distributed.compile import compile_enabled
    from meshforge.distributed.env import device_policy

    # (a model.hf_model keeps init_device auto, which its rules require: a shape-only build takes the meta path)
    model = cfg.model if cfg.model.hf_model else cfg.model.model_copy(update={"init_device": "meta"})
    c = cfg.model_copy(update={"model": model,
                               "training": cfg.training.model_copy()})
    notes = []
    import torch

    with device_policy(device_type(cfg)):
        if compile_enabled(c.training.compile, torch.device("cpu")) and c.training.compile_backend != "aot_eager":
            c.training.compile_backend = "aot_eager"
            notes.append("training.compile: traced with the aot_eager backend (inductor's graphs, eager kernels)")
    return c, notes


def device_type(cfg) -> str:
    """The device whose defaults the traced run takes: the config's (auto means a GPU run)."""
    return "cpu" if cfg.training.device == "cpu" else "cuda"


def trace_rank(cfg, world_size: int, rank: int, fold: bool = True) -> RankTrace:
    """Trace rank `rank` of `cfg` on `world_size` ranks (see the module docstring)."""
    import torch

    from meshforge.bench.measure import state_bytes
    from meshforge.distributed.pipeline import PipelineParallelModel
    from meshforge.scale.comm import CommRecorder
    from meshforge.scale.memory import StepMemory
    from meshforge.scale.rank import build_rank, micro_batches, warm_optimizer
    from meshforge.scale.world import fake_world

    cfg, notes = traced_config(cfg)
    _reset_peak_rss()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    torch._dynamo.reset()
    with fake_world(world_size, rank, device_type(cfg)) as fake:
        trainer = build_rank(cfg, world_size, rank, fake)
        pm, mesh_ctx = trainer.pm, trainer.mesh_ctx
        warm_optimizer(trainer, fake)
        build_s = time.perf_counter() - wall0
        batch = micro_batches(cfg, mesh_ctx, fake)
        n = len(batch)
        piped = isinstance(pm, PipelineParallelModel)
        folded = fold and not piped and n > FOLDED
        # the skipped micro batches' data stays alive (in `batch`), as in a real step that holds the whole batch
        run = [batch[0], batch[1], batch[-1]] if folded else batch
        comm = CommRecorder(mesh_ctx.layout, rank)
        memory = StepMemory(comm)
        # what the rank holds before the step: parameters (and gradients), optimizer state, and every other fake
        # tensor alive (a strategy's flat buffers, pipeline buffers): MemTracker counts only storages it is told of
        # or sees an op make; a C++-held buffer (DDP's reducer buckets) it sees from its first use only
        memory.track_external(*pm.parts, trainer.optimizer)
        memory.track_external(*(t for t in _fake_tensors(fake) if t.untyped_storage() not in memory._WINFO))
        held: dict = {}
        mb = [0]

        def next_micro_batch(_module, _args):
            comm.phase = memory.phase = f"mb{mb[0]}"
            mb[0] += 1

        def clock(part: str) -> None:
            if part == "forward_backward":
                comm.phase = memory.phase = "post"
            elif part == "schedule":  # after the update, before zero_grad: what the rank holds
                held.update(state_bytes(pm.parts, trainer.optimizer, pm.strategy))

        hook = None if piped else pm.model.register_forward_pre_hook(next_micro_batch, prepend=True)
        step0 = time.perf_counter()
        try:
            with fake, memory:
                trainer.train_step(clock=clock, batch=run)
        finally:
            if hook is not None:
                hook.remove()
        step_s = time.perf_counter() - step0
        peak = memory.peak()
        notes.append(f"peak: {memory.peak_at}")
    if folded:
        notes.append(f"{n} micro batches folded to {FOLDED} (micro batch 1's collectives counted {n - 2} times)")
    return RankTrace(rank, world_size, mesh_ctx.layout, peak,
                     {k: int(held[k]) for k in ("params", "grads", "optimizer")},
                     comm.totals({"mb1": n - 2} if folded else None), n if not piped else pm.plan.n_microbatches,
                     len(run) if not piped else pm.plan.n_microbatches, build_s, step_s,
                     time.process_time() - cpu0, _peak_rss(), notes)


def _fake_tensors(fake) -> list:
    """Every tensor of the fake mode `fake` the Python heap holds."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()  # what only cycles keep (the probe of a pipeline's stage 0) is not the rank's
    return [o for o in gc.get_objects() if isinstance(o, FakeTensor) and o.fake_mode is fake]


def _reset_peak_rss() -> None:
    """Start the process's peak-RSS count afresh (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
