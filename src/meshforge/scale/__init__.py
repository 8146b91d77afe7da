"""The scale trace: the real program for chosen ranks of an N-rank job, run inside one CPU process.

`meshforge plan CONFIG --world-size N --trace [--ranks 0,last]` builds the real parallel model of each chosen rank
with torch's fake process group (`fake` backend: collectives return at once and move nothing) and fake tensors
(`FakeTensorMode`: shapes, dtypes and storages without data), runs one real training step of the configured
layout (`Trainer.train_step`: forward, backward, clipping, optimizer; the pipeline schedule included) and
reports the rank's peak memory by category (torch's `MemTracker`) and every collective with its bytes per mesh
axis; `compare.py` sets it beside the plan.

  world.py    the fake world of one rank: process group, device meshes, fake tensors, the CUDA defaults
  rank.py     the rank's run, built as `Trainer.build` builds it (meta, parallelised, materialised fake)
  memory.py   peak memory by category (MemTracker, per-module bookkeeping off) and state after the step
  comm.py     collectives per (mesh axis, kind), in the bench's full-buffer bytes
  trace.py    one rank's trace (the step, micro batches folded when they repeat), its estimate and limits
  compare.py  the plan beside the trace
  cli.py      `meshforge plan` (the planner's command, with --trace)

Import-light: `meshforge plan` without --trace imports this package's cli only, which imports no torch.
"""
