"""Hang diagnosis: when a collective does not complete within `distributed.timeout_minutes`, one summary naming
the step, the mesh axis, the collective and its group, which ranks entered it and which did not, and the missing
ranks' Python stacks (docs/faults.md).

The record is torch's own flight recorder, which every process group keeps in C++ (gloo since torch 2.8, on by
default; `TORCH_FR_BUFFER_SIZE` entries, set here before the first process group unless the user chose): each
collective a process group issues, from Python or from C++ (DDP's gradient buckets, DTensor's functional
collectives), is one entry with its group and its sequence number in that group. Nothing is wrapped: no Python
function of torch.distributed is replaced, so no identity check of torch (P2POp's isend/irecv) can see a stranger.
Point-to-point sends and receives are not recorded on gloo (measured, torch 2.13): a hang in one is summarised
from the ranks' steps and stacks alone. On CUDA, NCCL's flight recorder also dumps its trace on a timeout
(`enable_nccl_flight_recorder`, called before the process group starts): NCCL's watchdog ends a hung job.

When a collective times out in the training loop (`timed_out`, called by the trainer before any teardown), the
rank asks the ranks of the groups it was last waiting on, through a store client of its own (the rendezvous'
TCPStore), for their recorded counts, step and main-thread stack: each rank's `_Watch` thread answers at once,
even a rank stuck in Python or sleeping (it needs the GIL, which a blocked collective or a sleep releases). The
first rank to time out prints the summary, then every rank that timed out prints its one line and exits
`HANG_EXIT` at once (`_end`); every wait here is bounded.

The watch thread costs the store almost nothing while nothing hangs: it sits in one server-side `wait` on its
rank's own key (renewed every `WATCH_WAIT_S`), so a rank makes 1 / WATCH_WAIT_S store requests a second however
many ranks there are (it polled once a second before: 16,384 requests a second at 16,384 ranks);
tests/unit/test_hang_store.py counts them.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

HANG_EXIT = 5  # a collective hung: the summary names where
RECENT = 16  # collectives reported per process group
FR_BUFFER = "2000"  # flight-recorder entries kept per process (all groups together), unless the user set it
ANSWER_WAIT_S = 15.0  # how long the reporting rank waits for the other ranks' answers
WATCH_WAIT_S = 86400.0  # how long one store wait of the watch thread lasts before it is renewed (torch logs
# two warning lines when one runs out)
_MESH_AXES = ("dp_cp", "dp_shard_cp", "dp", "dp_shard", "dp_replicate", "tp", "pp", "cp", "ep", "ep_shard")


def enable_flight_recorder() -> None:
    """Before the first process group: torch's flight recorder keeps the last `FR_BUFFER` collectives (the user's
    `TORCH_FR_BUFFER_SIZE` wins; 0 turns the record, and with it the summary, off)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)


def _fr_dump() -> dict | None:
    """This process's flight-recorder entries (torch's JSON dump, no stacks), None where torch has none."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:
        return json.loads(dump(True, False))
    except (RuntimeError, ValueError):
        return None


def recorded(dump: dict | None) -> dict[str, list[tuple[int, str, bool]]]:
    """{process group name: [(sequence number, op, retired), ...] in the order issued} from a flight-recorder
    dump: collectives only (a point-to-point entry has no collective sequence number)."""
    out: dict[str, list] = {}
    for e in (dump or {}).get("entries", []):
        if e.get("is_p2p") or not e.get("collective_seq_id"):
            continue
        op = str(e.get("profiling_name", "?")).split(":", 1)[-1]
        out.setdefault(str(e["process_group"][0]), []).append((int(e["collective_seq_id"]), op,
                                                               bool(e.get("retired"))))
    return out


class _Recorder:
    def __init__(self, axes: dict[str, str], rank: int, step: Callable[[], int], timeout_minutes: float):
        self.axes, self.rank, self.step = axes, rank, step  # {process group name: "dp_cp/dp/..."}
        self.timeout_minutes = timeout_minutes

    def name(self, pg: str) -> str:
        if pg in self.axes:
            return self.axes[pg]
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        return "world" if world is not None and pg == world.group_name else "a group outside the mesh"

    def state(self) -> dict:
        """This rank's answer: its step, its count and last collectives per group, its main thread's stack."""
        main = sys._current_frames().get(threading.main_thread().ident)
        stack = traceback.format_stack(main)[-8:] if main is not None else []
        rec = recorded(_fr_dump())
        return {"rank": self.rank, "step": self.step(), "counts": {g: v[-1][0] for g, v in rec.items()},
                "recent": {g: [list(x) for x in v[-RECENT:]] for g, v in rec.items()}, "stack": "".join(stack)}


_REC: _Recorder | None = None


def _groups() -> dict[str, list[int]]:
    """{process group name: its global ranks} of every group this process is in."""
    try:
        names = dist.distributed_c10d._world.pg_names
        return {name: dist.get_process_group_ranks(pg) for pg, name in names.items()}
    except (AttributeError, RuntimeError, ValueError):
        return {}


def install(mesh_ctx, rank: int, step: Callable[[], int], timeout_minutes: float) -> None:
    """Name this rank's process groups by mesh axis (gloo) and answer a peer's hang report. Idempotent."""
    global _REC
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    axes: dict[str, str] = {}
    for axis in _MESH_AXES:
        try:
            group = mesh_ctx.group(axis)
        except (KeyError, ValueError):
            continue
        if group is not None:
            pg = group.group_name
            axes[pg] = f"{axes[pg]}/{axis}" if pg in axes else axis
    _REC = _Recorder(axes, rank, step, timeout_minutes)
    _Watch.start(rank)


def uninstall() -> None:
    """Stop answering."""
    global _REC
    _REC = None
    _Watch.stop()


def timed_out(err: BaseException) -> None:
    """Called with an error of the training loop before anything is torn down: a collective that timed out ends
    here (the summary, this rank's line, exit `HANG_EXIT`); any other error returns."""
    rec = _REC
    if rec is not None and isinstance(err, RuntimeError) and "imed out" in str(err):
        _end(rec, err)


def failed_line(rank: int, err: BaseException, timeout_minutes: float) -> str:
    """The one line of a rank whose collective timed out or lost its peer."""
    first = (str(err).strip().splitlines() or [""])[0]
    return (f"rank {rank}: a collective failed ({first[:160]}): another rank died or hangs "
            f"(distributed.timeout_minutes={timeout_minutes:g})")


def _end(rec: _Recorder, err: BaseException) -> None:
    """A collective timed out here: the summary (from the first rank to time out), this rank's one line, and exit
    `HANG_EXIT` now: the teardown after a failed collective can wait on the hung peer as long as it hangs, and
    nothing is left to save (a save in progress stays `.partial`, as after a kill)."""
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


def _bell(rank: int) -> str:
    return f"{_prefix()}ask/rank{rank}"


class _Watch:
    """Each rank's thread that answers a hang report: it sits in one store `wait` on its own key (the server
    answers when the key is set; the wait is renewed every `WATCH_WAIT_S`, so a rank makes 1 / WATCH_WAIT_S store
    requests a second, whatever the world size), and writes this rank's state when the reporting rank rings it.
    `stop` rings it too, and joins it: no thread is left in a store call when the process exits (one blocked
    there while its store goes away aborts the process)."""

    _thread: threading.Thread | None = None
    _rank = 0

    @classmethod
    def start(cls, rank: int, store_factory: Callable = _store) -> None:
        if cls._thread is not None and cls._thread.is_alive():
            return
        store = store_factory()
        if store is None:
            return
        try:
            store.delete_key(_bell(rank))  # a previous run's ring in this process
        except Exception:  # noqa: BLE001 - no store, no answers: the one-line error still comes
            return
        cls._rank = rank
        cls._thread = threading.Thread(target=cls._run, args=(rank, store), name="meshforge-hang-watch",
                                       daemon=True)
        cls._thread.start()

    @classmethod
    def stop(cls, store_factory: Callable = _store) -> None:
        thread, cls._thread = cls._thread, None
        if thread is None or not thread.is_alive():
            return
        store = store_factory(timeout_s=2.0)
        try:
            if store is not None:
                store.set(_bell(cls._rank), "stop")
        except Exception:  # noqa: BLE001 - the store is gone: so is the thread's wait
            pass
        thread.join(timeout=5.0)

    @staticmethod
    def _run(rank: int, store) -> None:
        key = _bell(rank)
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=WATCH_WAIT_S))
                break
            except Exception as err:  # noqa: BLE001 - a wait that ran out is renewed; a store that went away ends it
                if "timeout" not in str(err):
                    return
        try:
            rec = _REC
            if store.get(key) == b"ask" and rec is not None:
                store.set(f"{_prefix()}rank{rank}", json.dumps(rec.state()))
        except Exception:  # noqa: BLE001 - the store went away with the job
            pass


def summary(rec: _Recorder) -> list[str] | None:
    """After a collective of this rank timed out: the summary lines when this rank is the one to print them
    (the first to ask), [] when another rank prints them, None when there is no store to ask through."""
    rank, timeout_minutes = rec.rank, rec.timeout_minutes
    store = _store()
    if store is None:
        return None
    dump = _fr_dump()
    mine, groups = recorded(dump), _groups()
    suspects = [g for g in _newest_first(dump) if g in groups] or [g for g in groups]
    asked = sorted({r for g in suspects for r in groups[g]})
    prefix = _prefix()
    try:
        store.set(f"{prefix}rank{rank}", json.dumps(rec.state()))
        if store.add(f"{prefix}reporter", 1) != 1:
            return []
        for r in asked:
            if r != rank:
                store.set(_bell(r), "ask")
        states = {rank: rec.state()}
        keys = [f"{prefix}rank{r}" for r in asked if r != rank]
        try:
            store.wait(keys, datetime.timedelta(seconds=ANSWER_WAIT_S))
        except Exception:  # noqa: BLE001 - some never answered: take those that did
            pass
        for r in asked:
            if r not in states and store.check([f"{prefix}rank{r}"]):
                states[r] = json.loads(store.get(f"{prefix}rank{r}"))
    except Exception:  # noqa: BLE001 - the store went away: no summary, the one-line error still comes
        return None
    step = states[rank]["step"]
    for g in suspects:  # the first collective of a suspect group that some of its ranks never entered
        members = groups[g]
        counts = {r: states[r]["counts"].get(g, 0) for r in members if r in states}
        mine_n, low = counts.get(rank, 0), min(counts.values(), default=0)
        if low < mine_n:  # some entered fewer: the first of this rank's they never entered
            first = low + 1
        elif len(counts) < len(members) and mine_n:  # all that answered agree: the silent ones are the suspects
            first = mine_n
        else:
            continue
        missing = [r for r in members if counts.get(r, -1) < first]
        entered = [r for r in members if r not in missing]
        op = next((o for s, o, _ in mine.get(g, []) if s == first), "collective")
        axis = rec.name(g)
        where = f"mesh axis {axis.split('/')[0]}" if g in rec.axes else axis
        lines = [f"hang: step {step}: {op} #{first} on {where} (group {axis}, ranks "
                 f"{members}) did not complete within distributed.timeout_minutes={timeout_minutes:g}; entered: "
                 f"ranks {entered}; never entered: ranks {missing}"]
        return lines + _where(states, missing, g, axis.split("/")[0])
    others = [r for r in asked if r != rank and (r not in states or states[r]["step"] != step)]
    lines = [f"hang: step {step}: an operation did not complete within distributed.timeout_minutes="
             f"{timeout_minutes:g}, and every rank of its groups entered the same recorded collectives (a "
             f"point-to-point transfer, which gloo does not record?); ranks at another step: {others}"]
    return lines + _where(states, others, None, None)


def _newest_first(dump: dict | None) -> list[str]:
    """The process groups of this rank's recorded collectives, that of the last one issued first (the blocked
    thread issued nothing after the collective that timed out), then those with a collective still unfinished."""
    entries = [e for e in (dump or {}).get("entries", []) if not e.get("is_p2p") and e.get("collective_seq_id")]
    out: list[str] = []
    for e in [*entries[-1:], *(e for e in entries if not e.get("retired"))]:
        g = str(e["process_group"][0])
        if g not in out:
            out.append(g)
    return out


def _where(states: dict, ranks: list[int], group: str | None, axis: str | None) -> list[str]:
    lines = []
    for r in ranks:
        s = states.get(r)
        if s is None:
            lines.append(f"hang: rank {r} did not answer within {ANSWER_WAIT_S:g} s (dead, or its process is "
                         "stuck holding the GIL)")
            continue
        head = f"hang: rank {r} is at step {s['step']}"
        if group is not None:
            last = (s["recent"].get(group) or [[0, "none", True]])[-1]
            head += f", its last collective on {axis} was {last[1]} #{last[0]}"
        lines.append(head + "; where it is (Python stack, innermost last):")
        lines += ["    " + ln for ln in s["stack"].rstrip().splitlines()]
    return lines


def nccl_dump_prefix(run_dir: str) -> str:
    """Where NCCL's flight recorder dumps rank R's trace on a timeout: this prefix + R."""
    return os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or os.path.join(run_dir, "nccl_trace_rank_")


def enable_nccl_flight_recorder(run_dir: str) -> str | None:
    """Turn NCCL's flight recorder on before the process group starts (values the user set win): the last
    `FR_BUFFER` collectives per rank, dumped on a timeout to `run_dir/nccl_trace_rank_<R>`. Returns where, None when the
    user chose otherwise."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", FR_BUFFER)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", nccl_dump_prefix(run_dir))
    if os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] in ("", "0"):
        return None
    return os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]


def dump_summary(prefix: str, since: float = 0.0) -> list[str]:
    """The hang summary from flight-recorder dumps, one file per rank (`prefix` + rank, torch's pickle format, as
    NCCL writes them on a timeout; files older than `since` are another run's): for each process group whose
    ranks' dumps disagree, its first collective that some never entered, who did and who did not, and each
    missing rank's last collective there. [] when there are no dumps or they all agree. A rank without a dump
    (another node's, on storage of its own) is named as such, never as one that did not enter."""
    folder, stem = os.path.split(prefix)
    dumps: dict[int, dict] = {}
    for f in sorted(Path(folder or ".").glob(stem + "*")):
        rank = f.name[len(stem):]
        if rank.isdigit() and f.stat().st_mtime >= since:
            try:
                dumps[int(rank)] = pickle.loads(f.read_bytes())  # noqa: S301 - torch's own dump in this run's folder
            except (OSError, pickle.UnpicklingError, EOFError, ValueError):
                continue
    seen = {r: recorded(d) for r, d in dumps.items()}
    members: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    for r, d in sorted(dumps.items()):
        for e in d.get("entries", []):
            descs.setdefault(str(e["process_group"][0]), str(e["process_group"][1]))
        for g in seen[r]:
            members.setdefault(g, []).append(r)
        for g, config in (d.get("pg_config") or {}).items():
            try:
                ranks = json.loads(config["ranks"]) if isinstance(config.get("ranks"), str) else config.get("ranks")
            except (ValueError, TypeError):
                continue
            if g and ranks:
                members[str(g)] = sorted(int(x) for x in ranks)
    lines = []
    for g, ranks in members.items():
        counts = {r: (seen[r].get(g) or [(0, "", True)])[-1][0] for r in ranks if r in dumps}
        if not counts or min(counts.values()) == max(counts.values()):
            continue  # the ranks that left a dump agree (another node's ranks may have left theirs elsewhere)
        first = min(counts.values()) + 1
        op = next((o for r in counts for s, o, _ in seen[r].get(g, []) if s == first), "collective")
        entered = [r for r in ranks if counts.get(r, -1) >= first]
        missing = [r for r in ranks if counts.get(r, first) < first]
        absent = [r for r in ranks if r not in counts]
        desc = descs.get(g, "")
        where = f"mesh axis {desc[5:]}" if desc.startswith("mesh_") else "a process group"
        lines.append(f"hang: {op} #{first} on {where} (process group {g} {desc!r}, ranks {ranks}) did not complete; "
                     f"entered: ranks {entered}; never entered: ranks {missing}" +
                     (f"; no dump from ranks {absent}" if absent else "") +
                     f" (from the flight recorder's dumps {prefix}<rank>)")
        for r in missing:
            last = (seen[r].get(g) or [(0, "none", True)])[-1]
            lines.append(f"hang: rank {r}'s last collective there was {last[1]} #{last[0]}")
    return lines
