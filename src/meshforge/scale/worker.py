"""Traces in a child process, one rank of each world size per process (`world.fake_world` says why).

`trace_jobs(world_size, rank, jobs)` runs `python -m meshforge.scale.worker` with the jobs as JSON on stdin; the
child traces each job (a config path, its overrides and a name) in turn and prints one JSON line per job:
the `RankTrace` as a dict, or {"error": one line} for a job that could not be traced (the others still run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

RESULT = "MESHFORGE-TRACE "  # prefix of the child's result lines (torch may print warnings on stdout)


def trace_jobs(world_size: int, rank: int, jobs: list[dict], timeout_s: float | None = None) -> list[dict]:
    """[{"name", "path", "overrides", "fold"?, "world_size"?, "rank"?}] -> one result dict per job, in order (see
    the module docstring; a job's own world size, of another size than `world_size`, and rank trace after)."""
    request = json.dumps({"world_size": world_size, "rank": rank, "jobs": jobs})
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "meshforge.scale.worker"], input=request, text=True,
                              capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return [{"name": j["name"], "error": f"the trace of rank {rank} took over {timeout_s:.0f} s"} for j in jobs]
    results = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if len(results) < len(jobs):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        results += [{"name": j["name"], "error": f"the trace process of rank {rank} ended (exit {proc.returncode}): "
                                                f"{tail}"} for j in jobs[len(results):]]
    return results


def run(request: dict) -> None:
    import torch

    from meshforge.config import ConfigError, load_config
    from meshforge.errors import MeshforgeError
    from meshforge.scale.trace import trace_rank

    for job in request["jobs"]:
        # a job may name a world of another size and its rank (`world.fake_world`: after the request's own jobs)
        world, rank = job.get("world_size", request["world_size"]), job.get("rank", request["rank"])
        out = {"name": job["name"]}
        try:
            cfg = load_config(job["path"], job.get("overrides", []), world_size=world)
            out.update(trace_rank(cfg, world, rank, fold=job.get("fold", True)).to_dict())
        except (ConfigError, MeshforgeError) as err:
            out["error"] = "; ".join(getattr(err, "problems", None) or [str(err)])
        except Exception as err:  # noqa: BLE001 - one job's failure is its result, the next job still runs
            out["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        torch._dynamo.reset()
        print(RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    run(json.loads(sys.stdin.read()))
