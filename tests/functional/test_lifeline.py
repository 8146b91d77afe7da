"""The launcher and its ranks (issue 26 item 5, issue 29 item 1): SIGUSR1 to `meshforge train --nproc-per-node N`
reaches the ranks, which save and exit 0; and no rank outlives its launcher, whatever killed it (SIGKILL), on
every launch path meshforge owns: its own launcher, `launch()` (bench, verify, the tests' shared launches), a
rank started by torchrun directly, and `meshforge train` tasks of an srun step (a stand-in for srun's step
daemon starts them with SLURM's variables and is killed). Nothing is marked complete after the launcher is gone.
These tests pay for their own launches."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshforge.testing.parity import base_overrides

pytestmark = [pytest.mark.dist, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 5.0


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("MESHFORGE_FAULT", None)
    return env


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
        except (OSError, ValueError):
            continue
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _gone_after_kill(pids: list[int]) -> float:
    t0 = time.perf_counter()
    while any(map(_alive, pids)) and time.perf_counter() - t0 < 30:
        time.sleep(0.02)
    return time.perf_counter() - t0


def _reap(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _steps(metrics: Path) -> list[int]:
    try:
        return [json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if ln.endswith("}")]
    except (OSError, ValueError, KeyError):
        return []


def _complete(ck: Path) -> set[str]:
    return {p.name for p in ck.glob("step_*") if (p / "manifest.json").is_file()}


def test_sigusr1_to_the_launcher_saves_and_a_killed_launcher_leaves_no_rank(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: lifeline}\n")
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    cmd = [sys.executable, "-m", "meshforge", "train", str(cfg), "--nproc-per-node", "2", *base_overrides(100000),
           "training.global_batch_size=4", "distributed.strategy=ddp", "logging.loggers=[jsonl]", "logging.log_every=1",
           f"run.output_dir={out}", "checkpoint.interval=3", "checkpoint.resume=auto"]
    ranks: list[int] = []
    try:
        # SIGUSR1 to the launcher alone (a scheduler's preemption notice): the ranks save and everything exits 0
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                start_new_session=True)
        _wait(lambda: len(_steps(out / "metrics.jsonl")) >= 2 or proc.poll() is not None, 300, "two logged steps")
        ranks = _children(proc.pid)
        os.kill(proc.pid, signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
        last = _steps(out / "metrics.jsonl")[-1]
        assert (ck / "LATEST").read_text().strip() == f"step_{last}", stdout[-2000:]
        assert f"saved step {last} and exiting (SIGUSR1)" in stdout and "Traceback" not in stderr
        assert len(ranks) == 2 and not any(map(_alive, ranks))

        # the same run resumed, then its launcher killed hard: the ranks stop at once, and commit nothing more
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                                start_new_session=True)
        _wait(lambda: _steps(out / "metrics.jsonl")[-1:] >= [last + 2] or proc.poll() is not None, 300,
              "the resumed run's steps")
        ranks = _children(proc.pid)
        assert len(ranks) == 2
        os.kill(proc.pid, signal.SIGKILL)
        gone_s = _gone_after_kill(ranks)
        assert gone_s < GONE_WITHIN_S, f"the ranks outlived their launcher by {gone_s:.1f} s"
        latest, complete = (ck / "LATEST").read_text(), _complete(ck)
        time.sleep(2)
        assert (ck / "LATEST").read_text() == latest and _complete(ck) == complete
        print(f"ranks gone {gone_s:.3f} s after the launcher's SIGKILL")
    finally:
        _reap(ranks)


def sleeper(spec) -> None:
    """A rank that only says who it is and waits (the target of the launches below)."""
    Path(spec["dir"], f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    time.sleep(600)


LAUNCH = """
import sys
from meshforge.launch import launch
launch(sys.argv[1], {"dir": sys.argv[2]}, nproc=2, timeout=600)
"""

# srun's step daemon (slurmstepd), as its tasks see it: their parent, which starts each with SLURM's variables of
# one task of a 2-task step on one node (the port: one SLURM reserved, `srun --resv-ports`) and then waits
FAKE_SRUN = """
import os, subprocess, sys, time
port, pids, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "127.0.0.1",
         "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_RESV_PORTS": port}
tasks = [subprocess.Popen(cmd, env={**os.environ, **slurm, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
         for r in range(2)]
with open(pids, "w") as f:
    f.write(" ".join(str(t.pid) for t in tasks))
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_rank_outlives_a_killed_launcher_on_launch_torchrun_or_srun(tmp_path):
    """Three paths at once (one wait for process start): a process calling launch() (bench, verify, a test
    session) killed hard, torch's own launcher with meshforge's worker under it (the rank follows its parent,
    the agent), and srun's step daemon with two `meshforge train` tasks under it, killed while they train."""
    target = f"{Path(__file__).resolve()}:sleeper"
    dirs = {"launch()": tmp_path / "launch", "torchrun": tmp_path / "torchrun", "srun": tmp_path / "srun"}
    for d in dirs.values():
        d.mkdir()
    (dirs["torchrun"] / "spec.json").write_text(json.dumps({"dir": str(dirs["torchrun"])}))
    (dirs["srun"] / "c.yaml").write_text("run: {name: srun-lifeline}\n")
    out = dirs["srun"] / "run"
    train = [sys.executable, "-m", "meshforge", "train", str(dirs["srun"] / "c.yaml"), *base_overrides(100000),
             "training.global_batch_size=4", "distributed.strategy=ddp", "logging.loggers=[jsonl]",
             "logging.log_every=1", f"run.output_dir={out}", "checkpoint.interval=2"]
    cmds = {"launch()": [sys.executable, "-c", LAUNCH, target, str(dirs["launch()"])],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                         "-m", "meshforge.launch", target, str(dirs["torchrun"])],
            "srun": [sys.executable, "-c", FAKE_SRUN, str(_free_port()), str(dirs["srun"] / "tasks.pid"), *train]}
    procs = {k: subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
                                 start_new_session=True) for k, c in cmds.items()}
    pids: dict[str, list[int]] = {}
    try:
        _wait(lambda: all(len(list(d.glob("rank*.pid"))) == 2 for k, d in dirs.items() if k != "srun")
              and len(_steps(out / "metrics.jsonl")) >= 3 or any(p.poll() is not None for p in procs.values()), 300,
              "every rank, and the srun tasks' third step")
        pids = {k: [int(p.read_text()) for p in sorted(d.glob("rank*.pid"))] for k, d in dirs.items() if k != "srun"}
        pids["srun"] = [int(p) for p in (dirs["srun"] / "tasks.pid").read_text().split()]
        agents = _children(procs["launch()"].pid)  # the torchrun agent launch() started
        assert all(len(v) == 2 and all(map(_alive, v)) for v in pids.values()), pids
        for p in procs.values():
            os.kill(p.pid, signal.SIGKILL)
        gone_s = {k: _gone_after_kill(v + (agents if k == "launch()" else [])) for k, v in pids.items()}
        print(f"ranks gone after their launcher's SIGKILL: {gone_s}")
        assert all(s < GONE_WITHIN_S for s in gone_s.values()), f"ranks outlived their launcher: {gone_s}"
        ck, steps = out / "checkpoints", _steps(out / "metrics.jsonl")
        committed = (_complete(ck), (ck / "LATEST").read_text() if (ck / "LATEST").exists() else None)
        time.sleep(2)
        assert _steps(out / "metrics.jsonl") == steps
        assert (_complete(ck), (ck / "LATEST").read_text() if (ck / "LATEST").exists() else None) == committed
    finally:
        _reap([*(p.pid for p in procs.values()), *(pid for v in pids.values() for pid in v)])
