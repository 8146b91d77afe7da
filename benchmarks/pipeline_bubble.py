"""Pipeline bubble per schedule: the measured idle fraction of every pp rank beside the theoretical one.

Launches `--pp` gloo CPU processes (one per stage group, dp = tp = 1; `meshforge.launch`), builds each
schedule's run with `Trainer.build` (the pipeline model training uses) and times real schedule steps (forward +
backward over `--microbatches` microbatches; the optimizer is left out, it is not part of the pipeline).
Each stage's compute is timed by wrapping torch's stage methods (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`); a rank's idle fraction is 1 - busy / step time, where the step time runs from
a barrier before the step to the end of that rank's step. Idle time is everything else: waiting for
activations or gradients of other stages (the bubble), plus the send/recv cost and the schedule's own
bookkeeping, which on CPU with gloo are not small next to a tiny model's compute.

Theory for 1F1B and GPipe with p stages and m microbatches of equal cost: (p-1)/(m+p-1). The interleaved
estimate (Megatron-LM) with v stages per rank is (p-1)/(v*m+p-1); zero-bubble schedules aim below it.
On a machine with fewer cores than processes, ranks also wait for a CPU, which shows up as compute time
of the running rank and idle time of the others: run it on an otherwise idle machine with >= pp cores, or
add `--emulate-ms T`: every forward then also sleeps T ms (a backward 2T, each half of a split backward T),
emulating device time that does not compete for CPUs, so the idle fraction is the schedule's own.

    python benchmarks/pipeline_bubble.py [--pp 4] [--microbatches 8] [--layers 8] [--dim 256] [--seq 128]
           [--steps 3] [--schedules 1f1b,gpipe,...] [--emulate-ms 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from meshforge.planning.theory import textbook_bubble

ALL = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "dfs", "v_schedule", "zero_bubble")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per schedule step (m)")
    p.add_argument("--layers", type=int, default=8, help="blocks (>= 2*pp for the multi-stage schedules)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="timed steps per schedule (after one warm-up step)")
    p.add_argument("--schedules", default=",".join(ALL))
    p.add_argument("--emulate-ms", type=float, default=0.0,
                   help="add this many ms of emulated device time (a sleep, no CPU) per forward per stage "
                        "(2x per full backward): isolates the schedule's bubble from CPU contention")
    return p.parse_args(argv)


theory = textbook_bubble  # the closed form lives in meshforge.planning


def _timed(fn, acc: list, emulate_s: float = 0.0, kind: str = "F"):
    """Time `fn` into acc[0]; with `emulate_s`, first sleep the emulated device time of the action (F: 1x,
    full backward: 2x, input or weight half of a split backward: 1x)."""

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            if emulate_s:
                full = kw.get("full_backward", a[2] if len(a) > 2 else True)
                time.sleep(emulate_s * (2 if kind == "B" and full else 1))
            return fn(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t0

    return wrapper


def measure(spec: dict) -> list:
    """Launch target: every schedule's idle fractions, gathered (rank 0's value is used)."""
    import torch
    import torch.distributed as dist

    from meshforge.config import load_config
    from meshforge.distributed.env import destroy, init_distributed
    from meshforge.training.trainer import Trainer

    args = argparse.Namespace(**spec)
    info = init_distributed("cpu", timeout_minutes=5)
    torch.manual_seed(0)
    rows = []
    for sched in args.schedules.split(","):
        ov = ["model.preset=tiny", f"model.n_layers={args.layers}", f"model.dim={args.dim}",
              f"model.ffn_dim={args.dim * 3}", "model.n_heads=4", "model.n_kv_heads=2", "data.source=synthetic",
              f"training.seq_len={args.seq}", f"model.max_seq_len={args.seq}", "training.device=cpu",
              f"training.global_batch_size={args.microbatches}", "training.micro_batch_size=1",
              "training.precision=fp32", f"distributed.pp_size={args.pp}",
              f"distributed.pipeline.pp_schedule={sched}", "distributed.pipeline.pp_microbatch_size=1"]
        pm = Trainer.build(load_config(None, ov, world_size=info.world_size), info).pm
        busy = [0.0]
        for st in pm.stages:
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                               ("backward_weight_one_chunk", "W")):
                setattr(st, name, _timed(getattr(st, name), busy, args.emulate_ms / 1000, kind))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (args.microbatches, args.seq + 1), generator=g)
        batch = [(x[:, :-1], x[:, 1:])]
        fracs, walls = [], []
        for step in range(args.steps + 1):
            for part in pm.parts:
                part.zero_grad(set_to_none=True)
            dist.barrier()
            busy[0] = 0.0
            t0 = time.perf_counter()
            pm.forward_backward(batch)
            wall = time.perf_counter() - t0
            if step > 0:  # step 0 includes the stages' shape inference
                fracs.append(1 - busy[0] / wall)
                walls.append(wall)
        mine = {"rank": info.rank, "idle": sum(fracs) / len(fracs), "wall": sum(walls) / len(walls),
                "stages": pm.stage_ids}
        everyone: list = [None] * info.world_size
        dist.all_gather_object(everyone, mine)
        rows.append((sched, pm.plan.stages_per_rank, everyone))
        del pm
        dist.barrier()
    destroy()
    return rows


def report(args, rows) -> None:
    p, m = args.pp, args.microbatches
    emu = f", emulated device time {args.emulate_ms:g} ms/forward/stage" if args.emulate_ms else ""
    print(f"pipeline bubble: pp={p} microbatches={m} layers={args.layers} dim={args.dim} seq={args.seq} "
          f"(gloo, CPU, {args.steps} timed steps, mean{emu})")
    head = f"{'schedule':<17}{'v':>2} " + " ".join(f"{'rank' + str(r):>7}" for r in range(p)) + \
        f" {'mean':>7} {'theory':>7} {'step s':>7}"
    print(head)
    print("-" * len(head))
    for sched, v, everyone in rows:
        idle = [e["idle"] for e in sorted(everyone, key=lambda e: e["rank"])]
        wall = max(e["wall"] for e in everyone)
        print(f"{sched:<17}{v:>2} " + " ".join(f"{i:>7.3f}" for i in idle) +
              f" {sum(idle) / len(idle):>7.3f} {theory(sched, p, m, v):>7.3f} {wall:>7.3f}")
    print("theory: (p-1)/(m+p-1) for 1f1b/gpipe; (p-1)/(v*m+p-1) (interleaved estimate) for multi-stage schedules")


def main(argv=None) -> int:
    from meshforge.launch import launch

    args = parse(argv)
    rows = launch(f"{Path(__file__).resolve()}:measure", vars(args), args.pp, timeout=1800).check().value
    report(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
