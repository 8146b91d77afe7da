"""One run per output directory and per checkpoints folder, and unwritable places found before the first step.

`claim(cfg, info)` (the trainer calls it before anything is written) does, on the ranks that write:
- the places (rank 0, before writing anything; `meshforge.outputs`): `run.output_dir` and a `checkpoint.dir` of
  its own are new, empty, or meshforge's own earlier run directory / checkpoints folder (the run's marker
  `.meshforge-output`, or what an older run left: `outputs.kind_of`); never the root, home, the working
  directory or above, and never inside another run directory or checkpoints folder (paths compared resolved).
  A folder of someone else's files is refused unless `run.overwrite=true`, which moves it aside (below);
- writability: rank 0 probes `run.output_dir`, every rank probes `checkpoint.dir` when checkpointing is on
  (each rank writes its own shards there), so a read-only place is one line at start, not a traceback after
  `checkpoint.interval` steps of lost work;
- the locks: rank 0 creates `.meshforge.lock` exclusively (pid, host, start time) in `run.output_dir` and in the
  checkpoints folder (wherever it is: a second run whose `checkpoint.dir` is this run's checkpoints folder, under
  any spelling, meets the same lock file). A second run into either fails with one line naming the holder; a
  lock whose process is gone (same host) is stale and taken over, with a line saying so;
- a fresh run (`checkpoint.resume=none`, or `auto` with no LATEST checkpoint to resume) into a directory that
  holds a run (a checkpoint, or metrics) is refused unless `run.overwrite=true`, which moves the old run aside
  into `<output_dir>.replaced-<UTC time>/` and says so: otherwise its checkpoints would be overwritten, its
  metrics truncated, and a later corrupt-checkpoint fallback could resume the old run's step;
- the marker: rank 0 marks the run directory as meshforge's (a checkpoints folder is recognised by its LATEST
  and step folders, and held by its lock while a run writes it).
`RunDir.begin(start_step, resumed_from)` (after the resume, before the first step): a run that resumed a path
(`checkpoint.resume=PATH`) but starts at step 0 (weights only, or a partial load) is a fresh run too, refused the
same way; then rank 0 writes the resolved `config.yaml`.
Every rank learns each outcome (one ConfigError, exit 2, on all of them). `release()` removes the locks.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from pathlib import Path

import meshforge.outputs as outputs
from meshforge.checkpoint.collectives import all_gather_object
from meshforge.checkpoint.paths import checkpoint_dir, complete_checkpoints, has_checkpoint
from meshforge.config.loader import write_yaml
from meshforge.errors import ConfigError
from meshforge.launch import restart_attempt

LOCK = outputs.LOCK


def writes_checkpoints(cfg) -> bool:
    c = cfg.checkpoint
    return bool(c.interval or c.save_final or c.save_consolidated)


def _probe(directory: Path, key: str, rank: int) -> str | None:
    """None when `directory` can be created and written to; else one line naming the key."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{outputs.PROBE}{socket.gethostname()}.{os.getpid()}.{rank}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        return f"{key}={directory} is not writable ({err.strerror or type(err).__name__}): choose a directory " \
               "this user can write"
    return None


def _written(write, key: str, where: Path) -> str | None:
    """Run `write()`; None, or the one line an OSError becomes (a full disk after the probe, a quota)."""
    try:
        write()
    except OSError as err:
        return f"{key}={where}: cannot write there ({err.strerror or type(err).__name__})"
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
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                return (f"{out} is locked by {path}, which is unreadable: if no run uses this directory, "
                        f"delete {path}"), None
            if host == me["host"] and not _alive(pid):
                path.unlink(missing_ok=True)
                note = f"took over a stale lock of process {pid} on {host} (it is gone)"
                continue
            return (f"{out} is in use by another run (pid {pid} on {host}, since {held.get('started_utc', '?')}): "
                    f"give this run its own run.output_dir and checkpoint.dir, or wait for that one (if it is gone, "
                    f"delete {path})"), None
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as err:  # created but not written (a full disk): not a lock anyone can read
            path.unlink(missing_ok=True)
            return f"{out}: cannot write the lock {path} ({err.strerror or type(err).__name__})", None
        return None, note
    return f"could not take the lock {path}", None


def _holds_run(cfg, out: Path, ignore: Path | None = None) -> list[Path]:
    """What of an earlier run a fresh run would destroy: its checkpoints (but `ignore`, the one this run
    loaded its weights from) and its metrics."""
    found = []
    ck = checkpoint_dir(cfg)
    mine = None if ignore is None else outputs.resolved(ignore)
    latest = ck / "LATEST"
    named = latest.read_text().strip() if latest.is_file() else None
    others = [c for c in complete_checkpoints(ck) if outputs.resolved(c) != mine]
    if others or (named and (mine is None or outputs.resolved(ck / named) != mine)):
        found.append(ck)
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    return found


def _move_aside(cfg, out: Path) -> str:
    """Move what the run directory (and a checkpoints folder of its own) holds into `<output_dir>.replaced-<UTC
    time>/`, all but this run's own lock files (a folder holding one is moved entry by entry around it)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    aside = out.with_name(f"{out.name}.replaced-{stamp}")
    aside.mkdir(parents=True, exist_ok=False)
    ck = checkpoint_dir(cfg)
    keep = {outputs.resolved(out / LOCK), outputs.resolved(ck / LOCK)}

    def move(src: Path, dst: Path) -> None:
        for entry in sorted(src.iterdir()):
            here = outputs.resolved(entry)
            if here in keep:
                continue
            if entry.is_dir() and not entry.is_symlink() and any(k.is_relative_to(here) for k in keep):
                (dst / entry.name).mkdir()
                move(entry, dst / entry.name)
            else:
                shutil.move(str(entry), str(dst / entry.name))

    move(out, aside)
    if ck.exists() and not outputs.resolved(ck).is_relative_to(outputs.resolved(out)):
        (aside / "checkpoints").mkdir()
        move(ck, aside / "checkpoints")
    return f"run.overwrite=true: moved the previous run in {out} aside to {aside}"


class RunDir:
    """What `claim` holds: `begin` once the start step is known, `release()` drops the locks (rank 0)."""

    def __init__(self, cfg, info, locks: list[Path], claimed: bool):
        self.cfg, self.info, self.locks, self.claimed = cfg, info, locks, claimed

    def begin(self, start_step: int, resumed_from: Path | None) -> None:
        """A path resume that starts at step 0 is a fresh run (refused over another run); then `config.yaml`."""
        cfg, out = self.cfg, Path(self.cfg.run.output_dir)
        problem = None
        if self.info.rank == 0 and self.claimed:
            r = cfg.checkpoint.resume
            if start_step == 0 and r not in (None, "auto") and (old := _holds_run(cfg, out, ignore=resumed_from)):
                problem = (f"run.output_dir={out} holds a run ({', '.join(str(p) for p in old)}) and "
                           f"checkpoint.resume={r} starts a new run at step 0 (it loads weights only), which would "
                           "overwrite it: choose another run.output_dir, or move that run away first")
            else:
                problem = _written(lambda: write_yaml(cfg, out / "config.yaml"), "run.output_dir", out)
        everyone = sorted({p for ps in all_gather_object([problem] if problem else []) for p in ps})
        if everyone:
            raise ConfigError(everyone)

    def release(self) -> None:
        for lock in self.locks:
            try:
                lock.unlink(missing_ok=True)
            except OSError:  # its folder turned read-only: the run's own error says so; a stale lock is taken over
                pass
        self.locks = []


def _writes_output_dir(cfg) -> bool:
    return bool(cfg.logging.loggers) or cfg.profiling.enabled or writes_checkpoints(cfg)


def _place_problems(cfg, out: Path, ck: Path, checkpoints: bool) -> tuple[list[str], bool]:
    """(problems, whether someone else's files are there): the run directory and a checkpoints folder of its own
    may hold only meshforge's own run / checkpoints (or nothing); someone else's files are refused unless
    run.overwrite moves them aside. Nothing is written."""
    problems, foreign = [], False
    same = checkpoints and outputs.resolved(ck) == outputs.resolved(out)  # checkpoint.dir = run.output_dir
    places = [(out, "run.output_dir", (outputs.RUN, outputs.CHECKPOINTS) if same else (outputs.RUN,))]
    if checkpoints and not outputs.resolved(ck).is_relative_to(outputs.resolved(out)):
        places.append((ck, "checkpoint.dir", (outputs.CHECKPOINTS,)))
    for path, key, kinds in places:
        problem = outputs.check_place(path, key)
        have = outputs.kind_of(path)
        if problem is None and have not in (None, *kinds):
            kind = kinds[0]
            problem = f"{key}={path} is a meshforge {have} folder, not a {kind} folder: give another {key}"
        alien = outputs.is_foreign(path)
        foreign |= alien
        if problem is None and alien and not cfg.run.overwrite:
            problem = (f"{key}={path} holds files meshforge did not write ({outputs.entries(path)}): give a new or "
                       "empty folder, or move them aside with checkpoint.resume=none run.overwrite=true")
        if problem:
            problems.append(problem)
    return problems, foreign


def claim(cfg, info, log=print) -> RunDir:
    """Check, lock and mark the run's directories (see the module docstring); every rank gets the same outcome."""
    out = Path(cfg.run.output_dir)
    ck = checkpoint_dir(cfg)
    problems: list[str] = []
    locks: list[Path] = []
    claimed = info.rank == 0 and _writes_output_dir(cfg)
    foreign = False
    if claimed:
        problems, foreign = _place_problems(cfg, out, ck, writes_checkpoints(cfg))
    if not problems and writes_checkpoints(cfg) and info.rank == 0 and (p := _probe(ck, "checkpoint.dir", 0)):
        problems.append(p)
    if claimed and not problems:
        problem = _probe(out, "run.output_dir", 0)
        same = outputs.resolved(ck) == outputs.resolved(out)
        for where in [out] if same or not writes_checkpoints(cfg) else [out, ck]:  # the checkpoints folder too
            if problem is None:
                problem, note = _take_lock(where)
                if problem is None:
                    locks.append(where / LOCK)
                    if note:
                        log(f"meshforge: {note}")
        resume = cfg.checkpoint.resume
        fresh = resume is None or (resume == "auto" and not has_checkpoint(cfg))  # this run starts at step 0
        own_restart = restart_attempt()[0] > 0 and resume == "auto" and not foreign  # this job's earlier attempt
        if problem is None and fresh and not own_restart and ((old := _holds_run(cfg, out)) or foreign):
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
            problem = _written(lambda: outputs.mark(out, outputs.RUN), "run.output_dir", out)
        if problem is not None:
            problems.append(problem)
    everyone = sorted({p for ps in all_gather_object(problems) for p in ps})
    if not everyone and writes_checkpoints(cfg) and info.world_size > 1:
        # the other ranks' write tests once rank 0 has looked and claimed (a test file in flight is not taken for
        # someone else's, and none lands in a folder being moved aside)
        problems = [p] if info.rank and (p := _probe(ck, "checkpoint.dir", info.rank)) else []
        everyone = sorted({p for ps in all_gather_object(problems) for p in ps})
    if everyone:
        RunDir(cfg, info, locks, claimed).release()
        raise ConfigError(everyone)
    return RunDir(cfg, info, locks, claimed)
