"""One run per output directory, and unwritable places found before the first step.

`claim(cfg, info)` (the trainer calls it before anything is written) does, on the ranks that write:
- writability: rank 0 probes `run.output_dir`, every rank probes `checkpoint.dir` when checkpointing is on
  (each rank writes its own shards there), so a read-only place is one line at start, not a traceback after
  `checkpoint.interval` steps of lost work;
- the lock: rank 0 creates `<run.output_dir>/.meshforge.lock` exclusively (pid, host, start time). A second
  run into the same directory fails with one line naming the holder; a lock whose process is gone (same host)
  is stale and taken over, with a line saying so;
- a fresh run (`checkpoint.resume=none`, or `auto` with no LATEST checkpoint to resume) into a directory that
  holds a run (a checkpoint, or metrics) is refused unless `run.overwrite=true`, which moves the old run aside
  into `<output_dir>.replaced-<UTC time>/` and says so: otherwise its checkpoints would be overwritten, its
  metrics truncated, and a later corrupt-checkpoint fallback could resume the old run's step;
- rank 0 then writes the resolved `config.yaml`.
Every rank learns the outcome (one ConfigError, exit 2, on all of them). `release()` removes the lock.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from pathlib import Path

from meshforge.checkpoint.collectives import all_gather_object
from meshforge.checkpoint.paths import checkpoint_dir, complete_checkpoints, has_checkpoint
from meshforge.config.loader import write_yaml
from meshforge.errors import ConfigError

LOCK = ".meshforge.lock"


def writes_checkpoints(cfg) -> bool:
    c = cfg.checkpoint
    return bool(c.interval or c.save_final or c.save_consolidated)


def _probe(directory: Path, key: str, rank: int) -> str | None:
    """None when `directory` can be created and written to; else one line naming the key."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".meshforge-write-test.{socket.gethostname()}.{os.getpid()}.{rank}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"{key}={directory} is not writable ({err.strerror or type(err).__name__}): choose a directory " \
               "this user can write"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _take_lock(out: Path) -> tuple[str | None, str | None]:
    """(problem, note): create the lock file exclusively; a stale one (its process gone) is taken over."""
    path = out / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    note = None
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
                pid, host = int(held["pid"]), str(held["host"])
            except (OSError, ValueError, KeyError, TypeError):
                return (f"{out} is locked by {path}, which is unreadable: if no run uses this directory, "
                        f"delete {path}"), None
            if host == me["host"] and not _alive(pid):
                path.unlink(missing_ok=True)
                note = f"took over a stale lock of process {pid} on {host} (it is gone)"
                continue
            return (f"{out} is in use by another run (pid {pid} on {host}, since {held.get('started_utc', '?')}): "
                    f"give this run its own run.output_dir and checkpoint.dir, or wait for that one (if it is gone, "
                    f"delete {path})"), None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None, note
    return f"could not take the lock {path}", None


def _holds_run(cfg, out: Path) -> list[Path]:
    """What of an earlier run a fresh run would destroy: its checkpoints and its metrics."""
    found = []
    ck = checkpoint_dir(cfg)
    if (ck / "LATEST").is_file() or complete_checkpoints(ck):
        found.append(ck)
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    return found


def _move_aside(cfg, out: Path) -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    aside = out.with_name(f"{out.name}.replaced-{stamp}")
    aside.mkdir(parents=True, exist_ok=False)
    for entry in sorted(out.iterdir()):
        if entry.name != LOCK:
            shutil.move(str(entry), str(aside / entry.name))
    ck = checkpoint_dir(cfg)
    if ck.exists() and not ck.resolve().is_relative_to(out.resolve()):
        (aside / "checkpoints").mkdir()
        for entry in sorted(ck.iterdir()):
            if entry.name != LOCK:
                shutil.move(str(entry), str(aside / "checkpoints" / entry.name))
    return f"run.overwrite=true: moved the previous run in {out} aside to {aside}"


class RunDir:
    """What `claim` holds; `release()` drops the locks (rank 0)."""

    def __init__(self, locks: list[Path]):
        self.locks = locks

    def release(self) -> None:
        for lock in self.locks:
            lock.unlink(missing_ok=True)
        self.locks = []


def _writes_output_dir(cfg) -> bool:
    return bool(cfg.logging.loggers) or cfg.profiling.enabled or writes_checkpoints(cfg)


def claim(cfg, info, log=print) -> RunDir:
    """Check and lock the run's directories (see the module docstring); every rank gets the same outcome."""
    out = Path(cfg.run.output_dir)
    problems: list[str] = []
    locks: list[Path] = []
    if writes_checkpoints(cfg) and (p := _probe(checkpoint_dir(cfg), "checkpoint.dir", info.rank)):
        problems.append(p)
    if info.rank == 0 and _writes_output_dir(cfg) and not problems:
        problem = _probe(out, "run.output_dir", 0)
        ck = checkpoint_dir(cfg)
        outside = writes_checkpoints(cfg) and not ck.resolve().is_relative_to(out.resolve())
        for where in [out, ck] if outside else [out]:  # a checkpoint.dir of its own is locked too
            if problem is None:
                problem, note = _take_lock(where)
                if problem is None:
                    locks.append(where / LOCK)
                    if note:
                        log(f"meshforge: {note}")
        resume = cfg.checkpoint.resume
        fresh = resume is None or (resume == "auto" and not has_checkpoint(cfg))  # this run starts at step 0
        if problem is None and fresh and (old := _holds_run(cfg, out)):
            if cfg.run.overwrite:
                log(f"meshforge: {_move_aside(cfg, out)}")
            elif resume is None:
                problem = (f"run.output_dir={out} holds a run ({', '.join(str(p) for p in old)}) and "
                           "checkpoint.resume=none would overwrite it: resume it (checkpoint.resume=auto), choose "
                           "another run.output_dir, or set run.overwrite=true to move the old run aside")
            else:
                problem = (f"run.output_dir={out} holds a run ({', '.join(str(p) for p in old)}) with no checkpoint "
                           "to resume (checkpoint.resume=auto found no LATEST), and a new run would overwrite it: "
                           "choose another run.output_dir, or start over with checkpoint.resume=none "
                           "run.overwrite=true (the old run is moved aside)")
        if problem is None:
            write_yaml(cfg, out / "config.yaml")
        else:
            problems.append(problem)
    everyone = sorted({p for ps in all_gather_object(problems) for p in ps})
    if everyone:
        RunDir(locks).release()
        raise ConfigError(everyone)
    return RunDir(locks)
