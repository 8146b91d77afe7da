"""`meshforge bench --profile-device`: what one device of this machine really does, measured inside the bench's own
process group, for `meshforge plan --calibrate` (planning/calibrate.py turns it into a device and its efficiencies).

Measured at the shapes the profiled config uses and around them:
  matmul       (m, n, k) products from 64 up to 4x the run's token count: a rate and a fixed time per kernel are
               fitted from them (the size curve the planner prices every matmul with)
  attention    scaled_dot_product_attention forward and backward (causal) at the run's heads and head width,
               for sequence lengths from a quarter to four times the run's
  kernels      one block of the config's own model (the real model code, one layer, the run's micro batch), forward
               and backward under a dispatch mode that times every kernel: the rate of its elementwise kernels
               (bytes of their inputs and outputs over their time: the effective memory bandwidth of the norms,
               RoPE, SwiGLU and copies as they really run, far below a streaming copy's on a CPU) and of its
               matmuls and attention, as a check on the curves above
  collectives  all_gather, reduce_scatter and all_reduce between the ranks, small to large (world size > 1)
Clock: on CPU the process's CPU time (the work of this process's threads: a CPU core is the device, and time other
jobs had the core does not enter it, though their cache and memory traffic still slows it), on CUDA synchronised
wall time. Each point is the median of repeats; every rank measures, rank 0's numbers are kept (collectives: the
slowest rank's). Load: the interleaved bench runs the block once per round of its timed steps (`probe_rounds_s`);
their median over the profile's own (`probe_s`) scales every measured time to the load the steps saw.
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Clock:
    """Seconds of device work: process CPU time on CPU, synchronised wall time on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.name = "process_cpu_time" if device.type == "cpu" else "wall"

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return _cpu_s()

    def median_s(self, fn, repeats: int = 5, inner: int = 1) -> float:
        fn()  # warm
        out = []
        for _ in range(repeats):
            t0 = self.now()
            for _ in range(inner):
                fn()
            out.append((self.now() - t0) / inner)
        return statistics.median(out)


def _inner(flops_or_bytes: float, scale: float) -> int:
    """Repeats inside one timing so that each lasts well above the clock's resolution (~1 ms of work)."""
    return max(1, min(200, int(scale / max(flops_or_bytes, 1.0))))


def profile_device(cfg, info, probe: BlockProbe | None = None, probe_rounds: list[float] | None = None) -> dict:
    """The profile (see the module docstring) on this process group; every rank must call it. `probe_rounds`: the
    probe's seconds once per round of the timed steps (the interleaved bench), to scale the rates to their load."""
    from meshforge.models import resolve_model_args

    dev = info.device
    clock = Clock(dev)
    dtype = torch.bfloat16 if (cfg.training.precision != "fp32" and dev.type == "cuda") else torch.float32
    a = resolve_model_args(cfg.model)
    tokens = cfg.training.micro_batch_size * cfg.training.seq_len
    scale = 1e8 if dev.type == "cpu" else 1e11
    out: dict = {"device": dev.type, "clock": clock.name, "world_size": info.world_size,
                 "threads": torch.get_num_threads(), "dtype": str(dtype),
                 "element_bytes": torch.tensor([], dtype=dtype).element_size()}
    if dev.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(dev)
        out["memory_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
    else:
        import os

        out["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    sizes = sorted({64, 128, 256, a.dim, a.ffn_dim, max(64, tokens // 4), tokens, min(4 * tokens, 4096)})
    mm = []
    for m in sizes:
        for n, k in ((a.dim, a.dim), (a.ffn_dim, a.dim), (m, m)):
            x, w = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(k, n, device=dev, dtype=dtype)
            mm.append([m, n, k, clock.median_s(lambda x=x, w=w: x @ w, inner=_inner(2 * m * n * k, scale))])
    out["matmul"] = mm
    att = []
    for s in sorted({max(16, cfg.training.seq_len // 4), cfg.training.seq_len // 2, cfg.training.seq_len,
                     2 * cfg.training.seq_len, 4 * cfg.training.seq_len}):
        q = torch.randn(1, a.n_heads, s, a.hd, device=dev, dtype=dtype, requires_grad=True)
        kv = [torch.randn(1, a.n_heads, s, a.hd, device=dev, dtype=dtype, requires_grad=True) for _ in range(2)]
        g = torch.randn(1, a.n_heads, s, a.hd, device=dev, dtype=dtype)

        def step(q=q, kv=kv, g=g):
            F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True).backward(g)

        fwd_flops = 2 * 2 * a.n_heads * a.hd * s * s / 2
        att.append([s, a.n_heads, a.hd, 3 * fwd_flops, clock.median_s(step, inner=_inner(3 * fwd_flops, scale))])
    out["attention"] = att
    probe = probe or BlockProbe(cfg, a, dev)
    out["kernels"] = probe.kernels()
    out["probe_s"] = statistics.median(probe.seconds() for _ in range(5))
    if probe_rounds:  # the same workload once per round of the timed steps: their load over the profile's
        out["probe_rounds_s"] = list(probe_rounds)
    if info.world_size > 1:
        out["collectives"] = _collectives(dev, dtype, clock, info)
    return out


MATMULS = ("mm", "addmm", "bmm", "_grouped_mm")
VIEWS = ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "alias", "detach", "unsqueeze",
         "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "empty", "empty_like", "empty_strided",
         "lift_fresh", "_reshape_alias", "view_as_real", "view_as_complex")


class KernelTimer(TorchDispatchMode):
    """Times every kernel (the clock's seconds around each aten op) by kind: matmul, attention, comm (the c10d ops'
    own time; their work on background threads is not inside it), elementwise (any other op that is not a view),
    and counts the elementwise ops' bytes (inputs + outputs) and matmul FLOPs. Ops on tensor subclasses (DTensor)
    are handed to the subclass first, so its inner ops are timed once."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock
        self.s = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0, "comm": 0.0}
        self.elementwise_bytes = 0
        self.matmul_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) for t in types):
            return NotImplemented
        full = func._schema.name
        name = full.split("::")[-1]
        if name in VIEWS:
            return func(*args, **(kwargs or {}))
        t0 = self.clock.now()
        out = func(*args, **(kwargs or {}))
        sec = self.clock.now() - t0
        if "c10d" in full.split("::")[0]:
            self.s["comm"] += sec
        elif name in MATMULS:
            self.s["matmul"] += sec
            x, w = args[-2], args[-1]
            self.matmul_flops += 2 * x.numel() * w.shape[-1]
        elif "attention" in name:
            self.s["attention"] += sec
        else:
            self.s["elementwise"] += sec
            self.elementwise_bytes += _nbytes(list(args)) + _nbytes(out)
        return out


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class BlockProbe:
    """One block of the config's model (one layer, the run's micro batch), forward and backward: the profile's
    in-situ kernels, and a reference workload the interleaved bench runs once per round, so that the device's
    rates, measured once, are scaled to the load the timed steps saw (`load_factor`)."""

    def __init__(self, cfg, a, dev):
        import dataclasses

        from meshforge.models import build_model

        one = dataclasses.replace(a, n_layers=1)
        self.model = build_model(one, device=str(dev))
        with torch.no_grad():
            for p in self.model.parameters():
                p.normal_(0, 0.02)
        b, s = cfg.training.micro_batch_size, cfg.training.seq_len
        self.x = torch.randint(0, one.vocab_size, (b, s), device=dev)
        self.bf16 = dev.type == "cuda" and cfg.training.precision == "bf16"
        self.clock = Clock(dev)
        self.tokens = b * s
        self.run()  # warm

    def run(self) -> None:
        from meshforge.models.loss import lm_loss

        with torch.autocast(self.x.device.type, torch.bfloat16, enabled=self.bf16):
            loss = lm_loss(self.model(self.x), self.x).mean
        loss.backward()
        self.model.zero_grad(set_to_none=True)

    def seconds(self) -> float:
        t0 = self.clock.now()
        self.run()
        return self.clock.now() - t0

    def kernels(self, repeats: int = 5) -> dict:
        """Its kernels timed by kind (`KernelTimer`), the median of `repeats` runs per kind."""
        timers = []
        for _ in range(repeats):
            timers.append(KernelTimer(self.clock))
            with timers[-1]:
                self.run()
        return {"seconds": {k: statistics.median(t.s[k] for t in timers) for k in timers[0].s},
                "elementwise_bytes": timers[0].elementwise_bytes, "matmul_flops": timers[0].matmul_flops,
                "tokens": self.tokens}


def _collectives(dev, dtype, clock: Clock, info) -> list:
    """[kind, full-buffer bytes, seconds] (the slowest rank's seconds)."""
    n_ranks = info.world_size
    rows = []
    for numel in (1 << 12, 1 << 16, 1 << 20):
        full = torch.randn(numel * n_ranks, device=dev, dtype=dtype)
        shard = torch.randn(numel, device=dev, dtype=dtype)
        ops = {"all_gather": (lambda f=full, s=shard: dist.all_gather_into_tensor(f, s), full),
               "reduce_scatter": (lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f), full),
               "all_reduce": (lambda f=full: dist.all_reduce(f), full)}
        for kind, (fn, buf) in ops.items():
            dist.barrier()
            sec = torch.tensor([clock.median_s(fn, repeats=3, inner=3)], dtype=torch.float64)
            dist.all_reduce(sec, op=dist.ReduceOp.MAX)
            rows.append([kind, buf.numel() * buf.element_size(), sec.item()])
    return rows
