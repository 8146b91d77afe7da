"""Training phases run one after another in one process group (a job of the suite's shared launches).

Each phase: {"name", "overrides", "steps", "env": {...}, "weights": bool, "corrupt": [file paths]}. `env` sets
MESHFORGE_FAULT for that phase's trainer; `corrupt` files get their last byte flipped by rank 0 first. Rank 0
returns {name: result} with the phase's losses, steps, weights (if asked) and what it printed.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import traceback
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from meshforge.testing.group import failed_ranks
from meshforge.testing.parity import config
from meshforge.training.trainer import train


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def phases_job(spec: dict, info) -> dict:
    results = {}
    for ph in spec["phases"]:
        os.environ.pop("MESHFORGE_FAULT", None)
        os.environ.update(ph.get("env", {}))
        if info.rank == 0:
            for f in ph.get("corrupt", []):
                flip_last_byte(Path(f))
        dist.barrier()
        out, err = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                res = train(config(ph["overrides"], ph["steps"], info.world_size), info)
                w = res.parallel_model.full_state_dict() if ph.get("weights") else {}
            r = {"losses": res.losses, "start_step": res.start_step, "final_step": res.final_step,
                 "stopped_by_signal": res.stopped_by_signal, "weights": w}
        except (Exception, CheckpointException) as e:  # reported to the test (DCP's is a BaseException)
            r = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        finally:
            os.environ.pop("MESHFORGE_FAULT", None)
        r.update(wall_s=time.perf_counter() - t0, stdout=out.getvalue(), stderr=err.getvalue())
        # every rank must agree on success/failure, or the next phase would deadlock
        r["ranks_failed"] = len(failed_ranks("error" in r, info))
        results[ph["name"]] = r
    return results
