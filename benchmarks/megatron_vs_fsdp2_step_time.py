"""Step time of megatron_fsdp (optim_grads_params) against fsdp2, as a ratio, at N ranks.

Both models are built in the same processes and their steps alternate (fsdp2, megatron_fsdp, fsdp2, ...),
so load on a shared machine hits both alike; the median of the timed steps is reported. One step = forward and
backward over this rank's micro-batches, gradient sync, clipping, AdamW step, post-step (megatron_fsdp copies
main -> compute shard). On CPU: gloo, fp32. On a GPU (`--device cuda`): NCCL, megatron_fsdp with bf16 compute
parameters and fp32 main parameters/reduction, fsdp2 with its CUDA default (bf16 params, fp32 reduce); at world
size 1 fsdp2 leaves the model unwrapped and runs it under bf16 autocast.

Usage: python benchmarks/megatron_vs_fsdp2_step_time.py [--nproc 2 4] [--presets tiny small] [--steps 6]
       [--device cpu|cuda] [--json out.json]   (launches itself with torchrun once per N)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ = {"tiny": 32, "small": 128}


def _build(strategy: list[str], preset: str, info, device: str):
    from meshforge.config import load_config
    from meshforge.distributed.mesh import MeshContext
    from meshforge.testing.parity import base_overrides
    from meshforge.training.optim import build_optimizer
    from meshforge.training.trainer import build_parallel_model, seed_everything

    ov = base_overrides(10) + [f"model.preset={preset}", f"training.seq_len={SEQ.get(preset, 128)}",
                               f"training.device={device}"] + strategy
    if device == "cuda":
        ov.append("training.precision=bf16")
    cfg = load_config(None, ov, world_size=info.world_size)
    seed_everything(cfg.run.seed)
    mesh_ctx = MeshContext.build(cfg.distributed, info.world_size, info.rank, info.device.type)
    pm = build_parallel_model(cfg, mesh_ctx, info.device)
    opt = build_optimizer(pm.param_groups(cfg.optimizer.weight_decay), cfg.optimizer, info.device)
    return cfg, pm, opt


def _step(pm, opt, mbs) -> None:
    pm.forward_backward(mbs)
    pm.clip_grad_norm_(1.0)
    opt.step()
    pm.after_optimizer_step()
    pm.zero_grad(opt)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from meshforge.distributed.env import init_distributed

    info = init_distributed(args.device, timeout_minutes=10)
    sync = (lambda: torch.cuda.synchronize()) if info.device.type == "cuda" else (lambda: None)
    out = {}
    for preset in args.presets:
        runs = {"fsdp2": ["distributed.strategy=fsdp2"],
                "megatron_fsdp": ["distributed.strategy=megatron_fsdp",
                                  "distributed.data_parallel_sharding_strategy=optim_grads_params"]}
        built = {k: _build(v, preset, info, args.device) for k, v in runs.items()}
        cfg = built["fsdp2"][0]
        dp_rank = built["fsdp2"][1].mesh_ctx.dp_rank
        dp = built["fsdp2"][1].mesh_ctx.dp_size
        n_micro = cfg.training.global_batch_size // (cfg.training.micro_batch_size * dp)
        g = torch.Generator().manual_seed(dp_rank)
        mbs = []
        for _ in range(n_micro):
            x = torch.randint(0, 256, (cfg.training.micro_batch_size, cfg.training.seq_len), generator=g)
            mbs.append((x, torch.roll(x, -1, 1)))
        times = {k: [] for k in runs}
        for i in range(args.warmup + args.steps):
            for k, (_, pm, opt) in built.items():
                if dist.is_initialized():
                    dist.barrier()
                sync()
                t0 = time.perf_counter()
                _step(pm, opt, mbs)
                sync()
                if dist.is_initialized():
                    dist.barrier()
                if i >= args.warmup:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[preset] = {"fsdp2_ms": med["fsdp2"] * 1e3, "megatron_fsdp_ms": med["megatron_fsdp"] * 1e3,
                       "ratio": med["megatron_fsdp"] / med["fsdp2"], "steps": args.steps,
                       "tokens_per_step": cfg.training.global_batch_size * cfg.training.seq_len}
        del built
    if info.rank == 0:
        Path(args.json).write_text(json.dumps(out))
    if dist.is_initialized():
        dist.destroy_process_group()


def run(nproc: int, presets: list[str], steps: int = 6, warmup: int = 2, device: str = "cpu",
        timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), "--worker", "--json", str(out), "--steps", str(steps),
               "--warmup", str(warmup), "--device", device, "--presets", *presets]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if not out.exists():
            raise RuntimeError(f"step-time run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = {}
    print(f"{'N':>3s} {'preset':8s} {'fsdp2 ms':>10s} {'megatron_fsdp ms':>17s} {'ratio mf/fsdp2':>15s}")
    for n in args.nproc:
        r = run(n, args.presets, args.steps, args.warmup, args.device)
        results[n] = r
        for preset, v in r.items():
            print(f"{n:3d} {preset:8s} {v['fsdp2_ms']:10.1f} {v['megatron_fsdp_ms']:17.1f} {v['ratio']:15.2f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
