"""Hang diagnosis: when a collective does not complete within `distributed.timeout_minutes`, one summary naming
the step, the mesh axis, the collective and its group, which ranks entered it and which did not, and the missing
ranks' Python stacks (docs/faults.md).

On gloo, `install` wraps torch.distributed's Python collectives so each call is counted per process group (which
the MeshContext names as mesh axes) in a small ring buffer of recent calls: host-side bookkeeping only (a counter
and a deque append), no tensor is read and no host synchronisation added. Collectives issued from C++ (DDP's
reducer, DTensor's functional collectives) are not seen; they are issued alike on every rank, so the counts of
the ranks still agree. On CUDA, NCCL's own flight recorder does this (`enable_nccl_flight_recorder`, called before
the process group starts): NCCL's watchdog ends a hung job and dumps its trace where the summary line says.

When a wrapped collective times out, the rank that saw it asks every rank, through a store client of its own
(the rendezvous' TCPStore), for its counts, step and main-thread stack: each rank's `_Watch` thread answers
within a second, even a rank stuck in Python or sleeping (it needs the GIL, which a blocked collective or a sleep
releases). The first rank to time out prints the summary, then every rank that timed out prints its one line and
exits `HANG_EXIT` at once (`_end`); every wait here is bounded.
"""

from __future__ import annotations

import collections
import datetime
import functools
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch.distributed as dist

HANG_EXIT = 5  # a collective hung: the summary names where
RECENT = 16  # collectives remembered per process group
ANSWER_WAIT_S = 15.0  # how long the reporting rank waits for the other ranks' answers
# (not isend/irecv: torch's P2POp accepts only torch's own two functions, and the pipeline schedules build
# `P2POp(dist.isend, ...)` at call time: a wrapper there failed every pipeline-parallel run on gloo)
_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
        "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "all_to_all", "all_to_all_single", "barrier",
        "reduce", "gather", "scatter", "send", "recv")


class _Recorder:
    def __init__(self, axes: dict, rank: int, step: Callable[[], int], timeout_minutes: float):
        self.axes, self.rank, self.step = axes, rank, step  # {process group: "dp_cp/dp/..."}
        self.timeout_minutes = timeout_minutes
        self.counts: dict = collections.defaultdict(int)  # process group -> collectives entered
        self.recent: dict = collections.defaultdict(lambda: collections.deque(maxlen=RECENT))
        self.timed_out: dict | None = None  # the collective that timed out here

    def name(self, group) -> str:
        return self.axes.get(group, "world" if group is None or group is _world() else "a group outside the mesh")

    def state(self) -> dict:
        main = sys._current_frames().get(threading.main_thread().ident)
        stack = traceback.format_stack(main)[-8:] if main is not None else []
        return {"rank": self.rank, "step": self.step(), "counts": {self.name(g): n for g, n in self.counts.items()},
                "recent": {self.name(g): list(r) for g, r in self.recent.items()},
                "stack": "".join(stack)}


_REC: _Recorder | None = None
_ORIGINAL: dict[str, Callable] = {}


def _world():
    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def _wrap(op: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        rec = _REC
        if rec is None:
            return fn(*args, **kwargs)
        group = kwargs.get("group") or _world()
        rec.counts[group] += 1
        seq, step = rec.counts[group], rec.step()
        rec.recent[group].append((seq, op, step))
        try:
            return fn(*args, **kwargs)
        except RuntimeError as err:
            if rec.timed_out is None and "imed out" in str(err):
                ranks = dist.get_process_group_ranks(group) if group is not None else []
                rec.timed_out = {"op": op, "axis": rec.name(group), "seq": seq, "step": step, "ranks": ranks}
                _end(rec, err)
            raise
    return recorded


def failed_line(rank: int, err: BaseException, timeout_minutes: float) -> str:
    """The one line of a rank whose collective timed out or lost its peer."""
    first = (str(err).strip().splitlines() or [""])[0]
    return (f"rank {rank}: a collective failed ({first[:160]}): another rank died or hangs "
            f"(distributed.timeout_minutes={timeout_minutes:g})")


def _end(rec: _Recorder, err: BaseException) -> None:
    """A recorded collective timed out here: the summary (from the first rank to time out), this rank's one line,
    and exit `HANG_EXIT` now: the teardown after a failed collective can wait on the hung peer as long as it hangs,
    and nothing is left to save (a save in progress stays `.partial`, as after a kill)."""
    from meshforge.launch import note_failure

    line = failed_line(rec.rank, err, rec.timeout_minutes)
    try:
        report = summary(rec)
        if report:
            print("\n".join(report), file=sys.stderr, flush=True)
        note_failure(rec.rank, line, secondary=not report)
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(HANG_EXIT)


def install(mesh_ctx, rank: int, step: Callable[[], int], timeout_minutes: float) -> None:
    """Record this rank's collectives per mesh axis (gloo) and answer a peer's hang report. Idempotent."""
    global _REC
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    axes: dict = {}
    for axis in ("dp_cp", "dp_shard_cp", "dp", "dp_shard", "dp_replicate", "tp", "pp", "cp", "ep", "ep_shard"):
        try:
            group = mesh_ctx.group(axis)
        except (KeyError, ValueError):
            continue
        if group is not None:
            axes[group] = f"{axes[group]}/{axis}" if group in axes else axis
    _REC = _Recorder(axes, rank, step, timeout_minutes)
    for op in _OPS:
        if op not in _ORIGINAL and hasattr(dist, op):
            _ORIGINAL[op] = getattr(dist, op)
            setattr(dist, op, _wrap(op, _ORIGINAL[op]))
    _Watch.start(rank)


def uninstall() -> None:
    """Give torch its collectives back and stop answering."""
    global _REC
    _REC = None
    _Watch.stop()
    for op, fn in _ORIGINAL.items():
        setattr(dist, op, fn)
    _ORIGINAL.clear()


def _prefix() -> str:
    from meshforge.launch import restart_attempt

    return f"meshforge/hang/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{restart_attempt()[0]}/"


def _store(timeout_s: float = 10.0):
    """A TCPStore client of its own on the rendezvous' store (None where there is none to reach)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return None
    try:
        return dist.TCPStore(addr, int(port), None, False, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store, no report: the one-line error still comes
        return None


class _Watch:
    """Each rank's thread that answers a hang report: it polls one key once a second (a `check`, never a blocking
    store call, so nothing waits on it at exit) and writes this rank's state when asked."""

    _thread: threading.Thread | None = None
    _stop = threading.Event()

    @classmethod
    def start(cls, rank: int) -> None:
        if cls._thread is not None and cls._thread.is_alive():
            return
        cls._stop = threading.Event()
        cls._thread = threading.Thread(target=cls._run, args=(rank, cls._stop), name="meshforge-hang-watch",
                                       daemon=True)
        cls._thread.start()

    @classmethod
    def stop(cls) -> None:
        cls._stop.set()

    @staticmethod
    def _run(rank: int, stop: threading.Event) -> None:
        store = _store()
        if store is None:
            return
        key = _prefix() + "asked"
        while not stop.wait(1.0):
            try:
                if store.check([key]):
                    rec = _REC
                    if rec is not None:
                        store.set(f"{_prefix()}rank{rank}", json.dumps(rec.state()))
                    return
            except Exception:  # noqa: BLE001 - the store went away with the job
                return


def summary(rec: _Recorder) -> list[str] | None:
    """After a collective of this rank timed out: the summary lines when this rank is the one to print them
    (the first to ask), [] when another rank prints them, None when there is no store to ask through."""
    rank, timeout_minutes, t = rec.rank, rec.timeout_minutes, rec.timed_out
    store = _store()
    if store is None:
        return None
    prefix = _prefix()
    try:
        store.set(f"{prefix}rank{rank}", json.dumps(rec.state()))
        first = store.add(f"{prefix}reporter", 1) == 1
        store.set(f"{prefix}asked", "1")
        if not first:
            return []
        others = [r for r in t["ranks"] if r != rank]
        states, deadline = {rank: rec.state()}, time.monotonic() + ANSWER_WAIT_S
        while len(states) < len(t["ranks"]) and time.monotonic() < deadline:
            for r in others:
                if r not in states and store.check([f"{prefix}rank{r}"]):
                    states[r] = json.loads(store.get(f"{prefix}rank{r}"))
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store went away: no summary, the one-line error still comes
        return None
    axis = t["axis"].split("/")[0]
    entered = [r for r in t["ranks"] if r in states and states[r]["counts"].get(t["axis"], 0) >= t["seq"]]
    missing = [r for r in t["ranks"] if r not in entered]
    lines = [f"hang: step {t['step']}: {t['op']} #{t['seq']} on mesh axis {axis} (group {t['axis']}, ranks "
             f"{t['ranks']}) did not complete within distributed.timeout_minutes={timeout_minutes:g}; entered: "
             f"ranks {entered}; never entered: ranks {missing}"]
    for r in missing:
        s = states.get(r)
        if s is None:
            lines.append(f"hang: rank {r} did not answer within {ANSWER_WAIT_S:g} s (dead, or its process is "
                         "stuck holding the GIL)")
            continue
        last = (s["recent"].get(t["axis"]) or [[0, "none", s["step"]]])[-1]
        lines.append(f"hang: rank {r} is at step {s['step']}, its last collective on {axis} was {last[1]} "
                     f"#{last[0]}; where it is (Python stack, innermost last):")
        lines += ["    " + ln for ln in s["stack"].rstrip().splitlines()]
    return lines


def enable_nccl_flight_recorder(run_dir: str) -> str | None:
    """Turn NCCL's flight recorder on before the process group starts (values the user set win): the last 2000
    collectives per rank, dumped on a timeout to `run_dir/nccl_trace_rank_<R>`. Returns where, None when the
    user chose otherwise."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(run_dir, "nccl_trace_rank_"))
    if os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] in ("", "0"):
        return None
    return os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
