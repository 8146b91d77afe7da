"""The one launcher of local process groups: torch's elastic launcher (torchrun), a spec in, per-rank results out.

- `run_cli(nproc, argv, nodes)`: `python -m meshforge ARGV` on N processes in the foreground, output streamed, as
  `meshforge train --nproc-per-node N` does (with `nodes`: as one node of `--nnodes M`); a failure is one line
  naming how many ranks failed.
- `launch(target, spec, nproc)`: call `target(spec)` in each of N fresh processes (one plain process at N=1)
  and collect every rank's return value. `target` is "package.module:function" or "path/to/file.py:function".
  A return value is anything `torch.save` writes and `torch.load(weights_only=True)` reads back (tensors,
  numbers, strings, lists, dicts). A rank that raises reports `Type: message` (a `MeshforgeError` its
  problems), its traceback kept aside; the launch's `error` is one line naming the first failing rank.

No process outlives the launcher that started it (`stop_with_launcher`, called first thing in every launched
process: `_worker` here, `meshforge train` under a launcher, also one started by torchrun or srun, and the agent
`launch` starts): the kernel kills it when its parent dies (Linux `PR_SET_PDEATHSIG`), and a watchdog thread
polling the parent's pid does the same wherever that is not available. SIGKILL, however the launcher ended
(SIGKILL included): a worker whose launcher is gone saves nothing and commits nothing (a save it was making
stays `.partial`, removed by the next run); its run lock is stale and the next run takes it over.

Restarts (`run_cli(..., max_restarts=N)`, `meshforge train --max-restarts N`): a failed attempt (any rank
failing) ends every rank, as torch's elastic agent does, and the whole job starts again as a fresh agent launch;
the ranks resume from the last committed checkpoint (`checkpoint.resume=auto`). meshforge loops around the agent
rather than passing torchrun `--max-restarts`, because the agent's own restarts neither tell the new ranks why
they restarted nor stop on a fault that repeats: here each attempt's cause (the first failing rank's one line, or
how it died) is printed, handed to the next attempt's ranks (`MESHFORGE_RESTART`, `MESHFORGE_RESTART_CAUSE`: the
log and metrics.jsonl carry them), and the same cause twice in a row ends the job.

This module is the only place meshforge spells out a torchrun command line.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAUNCHER_PID = "MESHFORGE_LAUNCHER_PID"  # set by a meshforge launcher: the pid its processes follow
# variables of an enclosing launch that must not leak into a nested one
LAUNCH_VARS = (LAUNCHER_PID, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_ERROR_FILE", "MESHFORGE_RESTART", "MESHFORGE_RESTART_CAUSE", "MESHFORGE_FAILURE_DIR")
RESTART, RESTART_CAUSE = "MESHFORGE_RESTART", "MESHFORGE_RESTART_CAUSE"  # the attempt (0 first), why it restarted
FAILURE_DIR = "MESHFORGE_FAILURE_DIR"  # where a failing rank leaves its one line (`note_failure`) for the launcher


def restart_attempt() -> tuple[int, str | None]:
    """(restarts before this process's attempt, the cause of the last one): meshforge's launcher's, else
    torchrun's own restart count (cause unknown)."""
    raw = os.environ.get(RESTART) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return (int(raw) if raw.isdigit() else 0), os.environ.get(RESTART_CAUSE) or None


def note_failure(rank: int, line: str, secondary: bool = False) -> None:
    """Leave this rank's one-line failure for a restarting launcher (`secondary`: it failed because a peer did,
    e.g. a collective lost its peer). Nothing without a meshforge launcher."""
    where = os.environ.get(FAILURE_DIR)
    if where and os.path.isdir(where):
        try:
            Path(where, f"rank{rank}.json").write_text(json.dumps({"line": line, "secondary": secondary}))
        except OSError:
            pass


# what torchrun and srun tell a process about its place in the job: whole numbers (a port: 1..65535)
_COUNTS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NNODES")
_INDICES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")


def launch_env_problems(env: dict[str, str] | None = None) -> list[str]:
    """One line per launcher variable that cannot be right (not a whole number, a rank outside the world, a port
    outside 1..65535): a traceback later otherwise."""
    env = os.environ if env is None else env
    problems, values = [], {}
    for key in (*_COUNTS, *_INDICES, "MASTER_PORT"):
        raw = env.get(key)
        if raw is None:
            continue
        low = 1 if key in _COUNTS or key == "MASTER_PORT" else 0
        high = 65535 if key == "MASTER_PORT" else None
        if not raw.strip().isdigit() or int(raw) < low or (high is not None and int(raw) > high):
            span = f"{low}..{high}" if high else f"a whole number >= {low}"
            problems.append(f"environment variable {key}={raw!r} must be {span} (torchrun and srun set it; unset it "
                            "to run one process)")
        else:
            values[key] = int(raw)
    for rank, world in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in values and world in values and values[rank] >= values[world]:
            problems.append(f"environment variable {rank}={values[rank]} is outside {world}={values[world]}")
    return problems


def address_in_use(err: BaseException) -> bool:
    """Whether a rendezvous failed because its port is taken (torch's DistNetworkError, or a RuntimeError)."""
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


_TIED = False


def stop_with_launcher(poll_s: float = 0.5) -> None:
    """End this process (SIGKILL) as soon as the launcher that started it is gone, whatever ended the launcher.
    The launcher is `$MESHFORGE_LAUNCHER_PID` when a meshforge launcher set it (read once, then removed, so a
    process this one starts follows its own parent), else this process's parent (torchrun's agent, srun's
    slurmstepd). Idempotent."""
    global _TIED
    want = os.environ.pop(LAUNCHER_PID, "")
    if _TIED:
        return
    parent = int(want) if want.isdigit() and int(want) != os.getpid() else os.getppid()
    if parent <= 1:  # started by init itself: there is no launcher to follow
        return
    _TIED = True
    if sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still follows the launcher
    if os.getppid() != parent:  # it died before the prctl took effect
        _launcher_gone(parent)
    threading.Thread(target=_watch_launcher, args=(parent, poll_s), name="meshforge-lifeline", daemon=True).start()


def _watch_launcher(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _launcher_gone(parent)


def _launcher_gone(parent: int) -> None:
    try:
        print(f"meshforge: the launcher (pid {parent}) is gone: process {os.getpid()} stops now, saving nothing",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):  # its stderr went with it
        pass
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Nodes:
    """This machine's part of a multi-node launch (`meshforge train --nnodes ...`). With `node_rank`, torch's
    static rendezvous at `rdzv_endpoint` (node 0's HOST:PORT, where its agent serves the store); without it,
    the c10d rendezvous assigns node ranks (every node runs the same command, the same `rdzv_id`)."""

    nnodes: int
    rdzv_endpoint: str
    node_rank: int | None = None
    rdzv_id: str = "meshforge"
    timeout_s: int = 600  # how long this node waits at the rendezvous for the others (distributed.rendezvous_timeout_s)

    @property
    def backend(self) -> str:
        return "c10d" if self.node_rank is None else "static"


def torchrun_args(nproc: int, entry: list[str], nodes: Nodes | None = None) -> list[str]:
    """torchrun's arguments for `nproc` processes per node running `entry` (["-m", module, ...] or
    [script, ...]): on this machine alone, or as one node of `nodes`."""
    if nodes is None:
        where = ["--standalone"]
    elif nodes.node_rank is not None:
        where = [f"--nnodes={nodes.nnodes}", f"--node-rank={nodes.node_rank}", "--rdzv-backend=static",
                 f"--rdzv-endpoint={nodes.rdzv_endpoint}", f"--rdzv-conf=timeout={nodes.timeout_s}"]
    else:
        where = [f"--nnodes={nodes.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.rdzv_endpoint}",
                 f"--rdzv-id={nodes.rdzv_id}", f"--rdzv-conf=join_timeout={nodes.timeout_s}"]
    return [*where, f"--nproc-per-node={nproc}", "--max-restarts=0", *entry]


RENDEZVOUS_TIMEOUT_EXIT = 4  # the other nodes never reached the rendezvous within distributed.rendezvous_timeout_s


class RendezvousGaveUp(Exception):
    """The rendezvous waited its whole timeout for nodes that never came; the message is the one line to print."""


class _TalkingRendezvous:
    """torch's rendezvous handler for this node (static or c10d), which says while it waits: after a second of
    waiting, one line naming the endpoint, the nodes joined of expected (c10d: read from the rendezvous state; a
    static rendezvous learns it only at the end) and the timeout, and a line more each time that count changes.
    Ctrl-C ends the wait at once (exit 130): the signal reaches a thread through a wakeup pipe, since the main
    thread may sit in a C++ store call that only returns at the timeout. Every other call goes to torch's."""

    def __init__(self, handler, nodes: Nodes):
        self._handler, self._nodes = handler, nodes
        self._seen: int | None = None  # the last count the wait read (the state forgets this node at the timeout)

    def __getattr__(self, name):  # get_backend, use_agent_store, shutdown, ... as torch's handler answers
        return getattr(self._handler, name)

    def joined(self) -> int | None:
        """Nodes at the rendezvous now (c10d), None where torch's handler does not tell."""
        try:
            import pickle

            backend = self._handler._state_holder._backend  # DynamicRendezvousHandler's state, private in torch
            got = backend.get_state()
            joined = None if got is None else len(pickle.loads(got[0]).participants)
            return joined or None  # 0: not yet written, or this node already left at the timeout
        except Exception:  # noqa: BLE001 - any torch version or store error: the count is unknown, the wait goes on
            return None

    def where(self, joined: int | None) -> str:
        n = self._nodes
        count = f"{joined} of {n.nnodes} nodes joined" if joined is not None else f"{n.nnodes} nodes expected"
        return f"{n.rdzv_endpoint} ({n.backend} rendezvous, id {n.rdzv_id}; {count})"

    def next_rendezvous(self):
        done, pipe = threading.Event(), os.pipe()
        os.set_blocking(pipe[1], False)
        try:
            old_wakeup = signal.set_wakeup_fd(pipe[1], warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no Ctrl-C watch, the wait is still reported
            old_wakeup = None
        watcher = threading.Thread(target=self._watch, args=(done, pipe[0]), name="meshforge-rendezvous", daemon=True)
        watcher.start()
        try:
            return self._handler.next_rendezvous()
        except Exception as err:
            if type(err).__name__ not in ("RendezvousTimeoutError", "DistStoreError") and "imed out" not in str(err):
                raise
            joined = self._seen
            counted = re.search(r"(\d+)/(\d+) clients joined", str(err))  # the static store's own count
            if joined is None and counted:
                joined = int(counted[1])
            raise RendezvousGaveUp(
                f"the other nodes never came to {self.where(joined)} within {self._nodes.timeout_s} s "
                "(distributed.rendezvous_timeout_s): start the same command on every node, each reaching that address "
                f"(exit {RENDEZVOUS_TIMEOUT_EXIT})") from None
        finally:
            done.set()
            if old_wakeup is not None:
                signal.set_wakeup_fd(old_wakeup)
            watcher.join(timeout=2)
            for fd in pipe:
                os.close(fd)

    def _watch(self, done: threading.Event, wakeup: int) -> None:
        import select

        start, said = time.monotonic(), None
        while not done.is_set():
            ready, _, _ = select.select([wakeup], [], [], 0.25)
            if done.is_set():
                return
            if ready:
                try:
                    got = os.read(wakeup, 64)
                except OSError:
                    return
                if int(signal.SIGINT) in got:
                    print(f"meshforge: Ctrl-C: stopped waiting for the other nodes at {self.where(self._seen)}; "
                          "nothing was started (exit 130)", file=sys.stderr, flush=True)
                    os._exit(130)
            waited = time.monotonic() - start
            if waited < 1.0:
                continue
            joined = self.joined()
            if done.is_set():
                return
            if joined is None and (said is not None or self._nodes.backend == "c10d" and waited < 5.0):
                continue  # c10d's count comes within moments; once said, an unknown count changes nothing
            self._seen = joined if joined is not None else self._seen
            if said is None or joined != said[0]:
                print(f"meshforge: waiting for the other nodes at {self.where(joined)}; {waited:.0f} s so far, "
                      f"giving up after {self._nodes.timeout_s} s (distributed.rendezvous_timeout_s); Ctrl-C stops "
                      "waiting", file=sys.stderr, flush=True)
                said = (joined,)


@contextlib.contextmanager
def _talking_rendezvous(nodes: Nodes | None):
    """While torch's launcher builds this node's rendezvous handler, wrap it in `_TalkingRendezvous`."""
    if nodes is None:
        yield
        return
    from torch.distributed.elastic.rendezvous import registry

    original = registry.get_rendezvous_handler

    def talking(params):
        return _TalkingRendezvous(original(params), nodes)

    registry.get_rendezvous_handler = talking
    try:
        yield
    finally:
        registry.get_rendezvous_handler = original


def first_failure_code(failures: dict) -> int:
    """The exit code to report for failed ranks: the first failing rank's own code (2 bad input, 3 a run
    that stopped itself), not the code of a peer the launcher then killed (a signal death, negative)."""
    own = [(getattr(f, "timestamp", 0), rank, f.exitcode) for rank, f in failures.items()
           if isinstance(f.exitcode, int) and f.exitcode > 0]
    return min(own)[2] if own else 1


def run_cli(nproc: int, argv: list[str], nodes: Nodes | None = None, shutdown_timeout: int | None = None,
            max_restarts: int = 0) -> int:
    """`python -m meshforge ARGV` on `nproc` local processes, in the foreground (this process is the agent);
    with `nodes`, as one node of a multi-node launch.
    A signal to this process reaches the ranks (they finish the step and save, given `shutdown_timeout`
    seconds before they are killed); it then exits 130 after SIGINT, 0 after SIGTERM/SIGUSR1 (a preempted run
    that saved), 128 + n after another signal n; one line, no traceback.
    A failed attempt starts again up to `max_restarts` times (module docstring), never after a signal and never
    into the same failure twice; the exit code is the last attempt's."""
    had = {k: os.environ.get(k) for k in (LAUNCHER_PID, RESTART, RESTART_CAUSE, FAILURE_DIR)}
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks follow this process (`stop_with_launcher`)
    try:
        with tempfile.TemporaryDirectory(prefix="meshforge-failures-") as failures:
            os.environ[FAILURE_DIR] = failures
            attempt, last = 0, None
            while True:
                os.environ[RESTART] = str(attempt)
                code, cause = _attempt(nproc, argv, nodes, shutdown_timeout, Path(failures))
                if cause is None or attempt >= max_restarts:
                    if cause is not None and max_restarts:
                        print(f"error: the job failed {attempt + 1} times ({max_restarts} restarts allowed); the last "
                              f"cause: {cause}", file=sys.stderr, flush=True)
                    return code
                if cause == last:
                    print(f"error: the same failure twice in a row, not restarting again: {cause}", file=sys.stderr,
                          flush=True)
                    return code
                attempt, last = attempt + 1, cause
                os.environ[RESTART_CAUSE] = cause
                print(f"meshforge: restart {attempt} of {max_restarts} after: {cause}; every rank starts again and "
                      "resumes from the last committed checkpoint", file=sys.stderr, flush=True)
                for f in Path(failures).iterdir():
                    f.unlink()
    finally:
        for k, v in had.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _attempt(nproc: int, argv: list[str], nodes: Nodes | None, shutdown_timeout: int | None,
             failures: Path) -> tuple[int, str | None]:
    """One agent launch: (exit code, the cause of a failure worth a restart, None when none is)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    def forward(signum, _frame):  # what torch's agent does for the signals it handles itself
        raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))

    extra = [f"--shutdown-timeout={shutdown_timeout}"] if shutdown_timeout else []
    largs = get_args_parser().parse_args([*extra, *torchrun_args(nproc, ["-m", "meshforge", *argv], nodes)])
    # torch's agent passes SIGTERM/SIGINT/SIGHUP/SIGQUIT on to the ranks; SIGUSR1 (preemption) would end this
    # process at once and leave the ranks running: pass it on the same way
    old_usr1 = signal.signal(signal.SIGUSR1, forward)
    try:
        with _talking_rendezvous(nodes):
            run(largs)
    except RendezvousGaveUp as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return RENDEZVOUS_TIMEOUT_EXIT, None
    except SignalException as err:
        sig = signal.Signals(err.sigval)
        code = 130 if sig == signal.SIGINT else 0 if sig in (signal.SIGTERM, signal.SIGUSR1) else 128 + int(sig)
        print(f"meshforge: {sig.name} received: the {nproc} processes were told to save and stop (exit {code})",
              file=sys.stderr, flush=True)
        return code, None
    except Exception as err:  # noqa: BLE001 - ChildFailedError carries the failing ranks' exit codes
        if address_in_use(err):  # the agent's own rendezvous store (node 0)
            endpoint = nodes.rdzv_endpoint if nodes else "the standalone rendezvous"
            print(f"error: --rdzv-endpoint {endpoint}: its port is in use (another job or a leftover process "
                  "holds it): choose another port", file=sys.stderr)
            return 2, None
        if type(err).__name__ != "ChildFailedError":
            raise
        failed = getattr(err, "failures", {})
        code = first_failure_code(failed)
        codes = sorted({f.exitcode for f in failed.values()})
        print(f"error: {len(failed)} of {nproc} processes failed (exit codes {codes}; the first failing rank's: "
              f"{code}); their messages are above", file=sys.stderr)
        return code, failure_cause(failed, failures)
    finally:
        signal.signal(signal.SIGUSR1, old_usr1)
    return 0, None


def failure_cause(failed: dict, notes: Path) -> str:
    """One line on why an attempt failed: a rank's own line (`note_failure`) over a signal death over a rank
    that failed because a peer did; ranks in order."""
    lines = {}
    for f in sorted(notes.glob("rank*.json")):
        try:
            lines[int(f.stem[4:])] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    own = [(r, v["line"]) for r, v in sorted(lines.items()) if not v.get("secondary")]
    if own:
        return f"rank {own[0][0]}: {own[0][1]}"
    signalled = sorted((f.exitcode == -signal.SIGTERM, r, f.exitcode) for r, f in failed.items()
                       if isinstance(f.exitcode, int) and f.exitcode < 0)  # SIGTERM last: the agent's own
    if signalled:
        _, rank, c = signalled[0]
        try:
            name = signal.Signals(-c).name
        except ValueError:
            name = f"signal {-c}"
        return f"rank {rank} was killed by {name}"
    if lines:
        rank, v = min(lines.items())
        return f"rank {rank}: {v['line']}"
    rank, f = min(failed.items()) if failed else (0, None)
    return f"rank {rank} exited with code {getattr(f, 'exitcode', '?')}"


@dataclass
class LaunchResult:
    ranks: list[Any]  # each rank's return value (None where a rank returned nothing or failed)
    errors: dict[int, dict] = field(default_factory=dict)  # rank -> {"error": one line, "traceback": ...}
    returncode: int = 0
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0

    @property
    def value(self) -> Any:
        """Rank 0's return value."""
        return self.ranks[0] if self.ranks else None

    @property
    def error(self) -> str | None:
        """One line: the first failing rank and its message, or how the launch died; None on success."""
        if self.errors:
            r = min(self.errors)
            return f"rank {r}: {self.errors[r]['error']}"
        if self.returncode != 0:
            tail = (self.stderr or self.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"exit code {self.returncode}: {tail[0][:300]}"
        return None

    def check(self) -> LaunchResult:
        """Raise RuntimeError with the error line, the failing rank's traceback and the output's tail."""
        if self.error is None:
            return self
        tb = next(iter(self.errors.values()), {}).get("traceback", "")
        raise RuntimeError(f"{self.error}\n{tb}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}")


def launch(target: str, spec: Any = None, nproc: int = 1, timeout: float = 900, env: dict | None = None,
           cwd: str | Path | None = None) -> LaunchResult:
    """Run `target(spec)` on `nproc` fresh local processes; every rank's return value comes back.
    `env` is their environment (default: this process's), less an enclosing launch's variables."""
    with tempfile.TemporaryDirectory(prefix="meshforge-launch-") as tmp:
        out = Path(tmp)
        (out / "spec.json").write_text(json.dumps(spec))
        entry = ["-m", "meshforge.launch", target, str(out)]
        cmd = [sys.executable, *entry] if nproc == 1 else \
            [sys.executable, "-m", "meshforge.launch", AGENT, *torchrun_args(nproc, entry)]
        base = {k: v for k, v in (os.environ if env is None else env).items() if k not in LAUNCH_VARS}
        base.setdefault("OMP_NUM_THREADS", "1")
        base[LAUNCHER_PID] = str(os.getpid())  # the agent (or the one process) follows this one
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base, cwd=cwd,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent and every rank it started
            stdout, stderr = proc.communicate()
            stderr += f"\nmeshforge.launch: killed after {timeout:.0f} s"
        result = LaunchResult([None] * nproc, returncode=proc.returncode, stdout=stdout, stderr=stderr,
                              wall_s=time.perf_counter() - t0)
        import torch

        for r in range(nproc):
            if (out / f"rank{r}.pt").exists():
                result.ranks[r] = torch.load(out / f"rank{r}.pt", weights_only=True)
            if (out / f"rank{r}.error.json").exists():
                result.errors[r] = json.loads((out / f"rank{r}.error.json").read_text())
        return result


def _resolve(target: str):
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        sys.path.insert(0, str(path.parent))  # its sibling helpers import as they do under pytest
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _worker(target: str, out_dir: str) -> int:
    """Inside each launched process: run the target, write this rank's result or error."""
    import torch

    stop_with_launcher()
    out, rank = Path(out_dir), int(os.environ.get("RANK", "0"))
    spec = json.loads((out / "spec.json").read_text())
    try:
        value = _resolve(target)(spec)
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the launching process
        problems = getattr(err, "problems", None)
        line = "; ".join(problems) if problems else f"{type(err).__name__}: {err}".strip().splitlines()[0]
        (out / f"rank{rank}.error.json").write_text(json.dumps({"error": line, "traceback": traceback.format_exc()}))
        print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)
        return 1
    torch.save(value, out / f"rank{rank}.pt")
    return 0


def exit_process(code: int) -> None:
    """End a launched worker without interpreter finalisation: its process groups were destroyed in order by
    then, and finalisation would tear down whatever C++ objects remain (process groups kept alive by a
    reference, their gloo threads) in arbitrary order, which now and then ends a finished run in
    "terminate called without an active exception" (SIGABRT) instead of its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


AGENT = "--agent"  # `python -m meshforge.launch --agent TORCHRUN_ARGS`: torchrun that follows its launcher


def _agent(torchrun_argv: list[str]) -> None:
    """torchrun's agent, tied to the process that started it; its ranks follow it in turn."""
    stop_with_launcher()
    os.environ[LAUNCHER_PID] = str(os.getpid())
    sys.argv = ["torch.distributed.run", *torchrun_argv]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if sys.argv[1] == AGENT:
        _agent(sys.argv[2:])
    else:
        exit_process(_worker(sys.argv[1], sys.argv[2]))
