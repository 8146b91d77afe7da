"""Run a list of training phases inside ONE launch of N gloo processes (checkpoint tests).

Usage: python -m torch.distributed.run --nproc-per-node N tests/checkpoint/_phases.py SPEC.json OUT_DIR
Each phase: {"name", "overrides", "steps", "env": {...}, "weights": bool, "corrupt": [relative file paths]}.
`env` replaces MESHFORGE_FAULT for that phase; `corrupt` files get their last byte flipped by rank 0 first.
Rank 0 writes OUT_DIR/results.json and OUT_DIR/<name>.weights.pt.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from meshforge.distributed.env import init_distributed
from meshforge.testing.parity import _cfg, full_weights
from meshforge.training.trainer import _train


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    info = init_distributed("cpu", timeout_minutes=spec.get("timeout_minutes", 3))
    results = {}
    for ph in spec["phases"]:
        os.environ.pop("MESHFORGE_FAULT", None)
        os.environ.update(ph.get("env", {}))
        if info.rank == 0:
            for f in ph.get("corrupt", []):
                flip_last_byte(Path(f))
        dist.barrier()
        t0 = time.perf_counter()
        try:
            res = _train(_cfg(ph["overrides"], ph["steps"]), info)
            w = full_weights(res.parallel_model) if ph.get("weights") else {}
            results[ph["name"]] = {"losses": res.losses, "start_step": res.start_step, "final_step": res.final_step,
                                   "stopped_by_signal": res.stopped_by_signal, "wall_s": time.perf_counter() - t0}
            if info.rank == 0 and w:
                torch.save(w, Path(out_dir) / f"{ph['name']}.weights.pt")
        except Exception as err:  # noqa: BLE001 - reported to the test
            results[ph["name"]] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(),
                                   "wall_s": time.perf_counter() - t0}
        # every rank must agree on success/failure, or the next phase would deadlock
        flags = [None] * info.world_size
        dist.all_gather_object(flags, "error" in results[ph["name"]])
        results[ph["name"]]["ranks_failed"] = sum(bool(f) for f in flags)
    if info.rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
