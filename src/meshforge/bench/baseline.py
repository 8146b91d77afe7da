"""The bare-PyTorch baseline: a hand-written loop on the same model, batch and precision, at world size 1.

`python -m meshforge.bench.baseline SPEC OUT` builds, in ONE process, both
- the bare loop: `build_model` + `init_weights` (same seed), AdamW with the same
  hyper-parameters, implementation and decay/no-decay split, autocast for bf16 (bf16 weights and fp32
  master weights in the optimizer for bf16_params),
  cross-entropy with gradient accumulation, `clip_grad_norm_`, the same lr
  schedule set by hand; its batches are the same global batches, materialised as
  tensors before timing (a hand-written loop's data is "just there");
- meshforge's path: `Trainer.build` and the training loop's own step (`Trainer.train_step`).

Machines are noisy (shared cores, frequency changes), so the two are interleaved
step by step: `rounds x steps` pairs, alternating which goes first (AB, BA, ...),
every step bracketed by a device synchronisation. The overhead ratio is the
median over pairs of (meshforge step / bare step), so slow drifts of the machine
cancel within a pair; its quartiles, the ratio of medians and the ratio of
minima are reported beside it, and the same median with the loader's own time
taken out of the meshforge step (`ratio_without_data`): the trainer draws every
batch from its data source inside the step, the bare loop does not.
A last untimed-for-the-ratio pass splits one step of each into its parts (data,
forward+backward, clip, optimizer, schedule, zero_grad), which is where any
overhead shows. Neither loop reads the loss back on the step (meshforge's does
so on log steps only; the bare loop returns the device tensor).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from meshforge.bench.measure import percentile, step_stats, sync, throughput_fields
from meshforge.config import load_config
from meshforge.data import batch_loader, build_source
from meshforge.distributed.env import DistInfo, pick_device
from meshforge.distributed.grad_norm import clip_grad_norm_
from meshforge.distributed.master_weights import MasterWeightAdamW, cast_to_bf16_with_masters
from meshforge.models import build_model, contract_of, init_weights, resolve_model_args
from meshforge.training.metrics import device_peak_tflops
from meshforge.training.optim import lr_factor, optimizer_impl
from meshforge.training.trainer import Trainer


class BareLoop:
    """What a user would write by hand; nothing from meshforge's trainer, strategies or loader."""

    def __init__(self, cfg, device: torch.device, batches: list[list[tuple[torch.Tensor, torch.Tensor]]]):
        torch.manual_seed(cfg.run.seed)
        self.model = build_model(cfg.model)
        init_weights(self.model, cfg.run.seed)
        bf16_params = cfg.training.precision == "bf16_params"  # bf16 weights, fp32 masters in the optimizer
        self.model.to(device=device).train()
        if bf16_params:
            cast_to_bf16_with_masters(self.model)
        o = cfg.optimizer
        impl = optimizer_impl(o)
        kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        adamw = MasterWeightAdamW if bf16_params else torch.optim.AdamW
        self.opt = adamw([g for g in groups if g["params"]], lr=o.lr, betas=tuple(o.betas), eps=o.eps, **kw)
        self.lr, self.sched_cfg, self.max_steps = o.lr, cfg.scheduler, cfg.training.max_steps
        self.lr_factor = lr_factor
        for g in self.opt.param_groups:
            g["lr"] = o.lr * lr_factor(0, cfg.scheduler, self.max_steps)
        self.clip, self.device = cfg.training.grad_clip, device
        # bf16_params: MasterWeightAdamW sums the gradients into fp32 `main_grad`s, which its clipping reads
        self.clip_fn = clip_grad_norm_ if bf16_params else torch.nn.utils.clip_grad_norm_
        self.bf16 = cfg.training.precision == "bf16"
        self.batches = [[(x.to(device), y.to(device)) for x, y in b] for b in batches]
        self.k = 0

    def step(self, parts: dict | None = None) -> torch.Tensor:
        t = _Clock(parts, self.device)
        micro = self.batches[self.k % len(self.batches)]
        t("data")
        total = torch.zeros((), device=self.device)
        for x, y in micro:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = self.model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / len(micro)).backward()
            total += loss.detach()
        t("forward_backward")
        if self.clip is not None:
            self.clip_fn(list(self.model.parameters()), self.clip)
        t("clip")
        self.opt.step()
        t("optimizer")
        for g in self.opt.param_groups:
            g["lr"] = self.lr * self.lr_factor(self.k + 1, self.sched_cfg, self.max_steps)
        t("schedule")
        self.opt.zero_grad(set_to_none=True)
        t("zero_grad")
        self.k += 1
        return total / len(micro)


class _Clock:
    """Accumulates device-synchronised time per named part into `parts` (no-op when parts is None)."""

    def __init__(self, parts: dict | None, device: torch.device):
        self.parts, self.device = parts, device
        if parts is not None:
            self._sync()
            self.t = time.perf_counter()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, name: str) -> None:
        if self.parts is None:
            return
        self._sync()
        now = time.perf_counter()
        self.parts[name] = self.parts.get(name, 0.0) + now - self.t
        self.t = now


class _TimedLoader:
    """The trainer's loader, timing each `next_batch` (host work, so no device sync is needed)."""

    def __init__(self, loader):
        self.loader, self.last = loader, 0.0

    def next_batch(self):
        t0 = time.perf_counter()
        batch = self.loader.next_batch()
        self.last = time.perf_counter() - t0
        return batch


def compare(cfg, steps: int, warmup: int, rounds: int, peak_override: float | None = None) -> dict:
    device = pick_device(cfg.training.device)
    trainer = Trainer.build(cfg, DistInfo(0, 1, 0, device, None))
    # the bare loop's data: the same global batches the trainer will see, as plain tensors
    t = cfg.training
    source = build_source(cfg.data, t.seq_len, resolve_model_args(cfg.model).vocab_size, cfg.run.seed)
    data = batch_loader(source, t.global_batch_size, t.micro_batch_size, 0, 1, cfg.run.seed)
    bare = BareLoop(cfg, device, [data.next_batch() for _ in range(min(4, warmup + steps))])

    timed_loader = trainer.loader = _TimedLoader(trainer.loader)

    def mf_step():
        return trainer.train_step()[0]

    paths = {"bare": bare.step, "meshforge": mf_step}
    first_losses = {name: float(step()) for name, step in paths.items()}  # same batch, same init
    for _ in range(max(0, warmup - 1)):
        for f in paths.values():
            f()
    times: dict[str, list[float]] = {"bare": [], "meshforge": []}
    pair_ratios, nodata_ratios = [], []
    for r in range(rounds * steps):
        order = ("bare", "meshforge") if r % 2 == 0 else ("meshforge", "bare")
        pair = {}
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            paths[name]()
            sync(device)
            pair[name] = time.perf_counter() - t0
            times[name].append(pair[name])
        pair_ratios.append(pair["meshforge"] / pair["bare"])
        nodata_ratios.append((pair["meshforge"] - timed_loader.last) / pair["bare"])
    breakdown: dict[str, dict] = {"bare": {}, "meshforge": {}}
    for _ in range(steps):
        bare.step(breakdown["bare"])
        trainer.train_step(_Clock(breakdown["meshforge"], device))
    breakdown = {k: {p: v / steps for p, v in d.items()} for k, d in breakdown.items()}

    model_ref = trainer.pm.unwrapped_parts()[0]
    fpt = contract_of(model_ref).flops_per_token(t.seq_len)
    peak = device_peak_tflops(device, peak_override or cfg.logging.peak_tflops)
    out: dict = {"settings": {"model": cfg.model.preset, "seq_len": t.seq_len, "global_batch_size": t.global_batch_size,
                              "micro_batch_size": t.micro_batch_size, "precision": t.precision,
                              "device": str(device), "threads": torch.get_num_threads(),
                              "strategy": cfg.distributed.strategy,
                              "n_params": sum(p.numel() for p in model_ref.parameters())},
                 "rounds": rounds, "steps_per_round": steps, "first_loss": first_losses}
    for name, ts in times.items():
        st = step_stats(ts)
        out[name] = {**st, **throughput_fields(st["step_s_median"], t.global_batch_size * t.seq_len, 1, fpt, peak)}
    out["ratio"] = statistics.median(pair_ratios)
    out["ratio_p25"], out["ratio_p75"] = percentile(pair_ratios, 0.25), percentile(pair_ratios, 0.75)
    out["ratio_of_medians"] = out["meshforge"]["step_s_median"] / out["bare"]["step_s_median"]
    out["ratio_of_minima"] = out["meshforge"]["step_s_min"] / out["bare"]["step_s_min"]
    out["pairs"] = len(pair_ratios)
    out["ratio_without_data"] = statistics.median(nodata_ratios)
    out["breakdown_s"] = breakdown
    return out


def run(spec: dict) -> dict:
    """Launch target (one process): the interleaved comparison."""
    cfg = load_config(spec.get("config"), spec["overrides"], world_size=1)
    return compare(cfg, spec["steps"], spec["warmup"], spec.get("rounds", 5), spec.get("peak_tflops"))
