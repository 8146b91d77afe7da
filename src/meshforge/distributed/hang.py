"""Hang diagnosis: a collective that does not complete within `distributed.timeout_minutes` ends the job with one
summary naming the step, the mesh axis, the collective and its group, which ranks entered it and which did not,
and where the missing ranks are (their Python stacks), instead of a bare timeout on the ranks that waited.

The record is torch's flight recorder (`TORCH_FR_BUFFER_SIZE`, on by default here: a ring of recent collectives
per process, kept in C++ by the process group, gloo and NCCL alike): each entry carries its group, its sequence
number in that group and its name. meshforge adds what torch does not know: which mesh axis a group is, and a
host-side mark of when each step began (no device work, no host synchronisation). On CUDA the NCCL watchdog also
dumps the flight recorder on a timeout (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`, files under `<output_dir>/flight_recorder/`,
read with `python -m torch.distributed.flight_recorder.fr_trace`).

Who says what: each rank runs a small thread that waits on the job's store for a request. The first rank whose
collective times out claims the report (an atomic compare-and-set), asks every rank, and waits up to ANSWER_S for
the answers: each rank's last collective per group, its current step, and its main thread's Python stack (the
thread answers even while the main thread sleeps or waits in C++; a rank that does not answer is gone, or its
Python holds the lock). A rank entered the hung collective when its last sequence number in that group reached
the reporter's. The other ranks that timed out wait for the summary and exit with one line. Exit code 4
(`CollectiveTimeout`) on every rank that timed out.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import pickle
import sys
import threading
import time
import traceback

import torch.distributed as dist

from meshforge.errors import CollectiveTimeout

ANSWER_S = 10.0  # how long the reporter waits for the other ranks' answers
_KEY = "meshforge/hang/"


def enable_flight_recorder(cuda: bool, output_dir: str) -> None:
    """Before the process group exists: torch's flight recorder on (the user's own settings win)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    if cuda:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")  # the name torch < 2.8 read
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        prefix = os.path.join(os.path.abspath(output_dir), "flight_recorder", "rank_")
        os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", prefix)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)


def is_timeout(err: BaseException) -> bool:
    text = str(err)
    return "Timed out" in text or "timed out" in text or "Watchdog caught collective operation timeout" in text


def _entries() -> list[dict]:
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:  # a torch without the generic flight recorder
        return []
    try:
        return pickle.loads(_dump_fr_trace()).get("entries", [])
    except Exception:  # noqa: BLE001 - a diagnosis must not fail the diagnosis
        return []


def _last_per_group(entries: list[dict]) -> dict[str, dict]:
    out = {}
    for e in entries:
        name = str(e["process_group"][0])
        if name not in out or e["collective_seq_id"] >= out[name]["seq"]:
            out[name] = {"seq": e["collective_seq_id"], "op": e.get("profiling_name", "?"),
                         "t": e.get("time_created_ns") or 0}
    return out


class HangWatch:
    """One per run: step marks, the axis of every group, and the answering thread (see the module docstring)."""

    def __init__(self, mesh_ctx, rank: int, world_size: int, timeout_minutes: float):
        self.rank, self.world, self.timeout_minutes = rank, world_size, timeout_minutes
        self.step = 0  # the step in progress (set by the trainer: a Python int, nothing more)
        self.marks: collections.deque = collections.deque(maxlen=256)  # (step, time_ns its start)
        self.axes: dict[str, tuple[str, list[int]]] = {}  # group name -> (axes, ranks)
        default = dist.distributed_c10d._get_default_group()
        self.axes[default.group_name] = ("world", list(range(world_size)))
        names: dict[str, list[str]] = {}
        for axis, mesh in (mesh_ctx._meshes or {}).items():
            if mesh.size() > 1:
                g = mesh.get_group()
                names.setdefault(g.group_name, []).append(axis.value)
                self.axes[g.group_name] = ("/".join(names[g.group_name]), dist.get_process_group_ranks(g))
        self.main = threading.main_thread().ident
        self._store = self._client()
        self._thread = threading.Thread(target=self._answer_when_asked, name="meshforge-hang", daemon=True)
        self._thread.start()

    @staticmethod
    def _client():
        """A store connection of this thread's own (a TCPStore client is not shared across threads)."""
        store = dist.distributed_c10d._get_default_store()
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT", "").isdigit():
            try:
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                      timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
            except Exception:  # noqa: BLE001 - fall back on the default store
                pass
        return dist.PrefixStore(_KEY, store)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.marks.append((step, time.time_ns()))

    def step_at(self, t_ns: int) -> int:
        return max((s for s, t in self.marks if t <= t_ns), default=self.step)

    # -------------------------------------------------------------- every rank
    def _answer_when_asked(self) -> None:
        try:
            self._store.wait(["request"], datetime.timedelta(days=30))
            self._store.set(f"rank{self.rank}", json.dumps(self._state()))
        except Exception:  # noqa: BLE001 - the store went away with the process group: nothing to answer
            return

    def _state(self) -> dict:
        frame = sys._current_frames().get(self.main)
        stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
        last = _last_per_group(_entries())
        return {"step": self.step, "last": {g: {**v, "step": self.step_at(v["t"])} for g, v in last.items()},
                "stack": stack}

    # ----------------------------------------------------------- a timed-out rank
    def diagnose(self, err: BaseException) -> CollectiveTimeout:
        """The error this rank ends with; the first rank here prints the summary for the job."""
        store = self._client()
        first = (str(err).strip().splitlines() or [""])[0][:200]
        try:
            reporter = int(store.compare_set("request", "", str(self.rank)))
        except Exception:  # noqa: BLE001 - the store is gone too: say what this rank knows
            return CollectiveTimeout(f"rank {self.rank}: a collective timed out at step {self.step} ({first})")
        if reporter != self.rank:
            deadline = time.time() + ANSWER_S + 5
            while time.time() < deadline and not _has(store, "summary"):
                time.sleep(0.2)
            err = CollectiveTimeout(f"rank {self.rank}: a collective timed out at step {self.step}; rank "
                                    f"{reporter} reports where the job hangs")
            err.secondary = True
            return err
        deadline = time.time() + ANSWER_S
        answers: dict[int, dict] = {}
        while time.time() < deadline and len(answers) < self.world:
            for r in range(self.world):
                if r not in answers and _has(store, f"rank{r}"):
                    answers[r] = json.loads(store.get(f"rank{r}"))
            time.sleep(0.1)
        lines = self.summary(answers, first)
        try:
            store.set("summary", "\n".join(lines))
        except Exception:  # noqa: BLE001
            pass
        return CollectiveTimeout(lines)

    def summary(self, answers: dict[int, dict], first: str) -> list[str]:
        mine = answers.get(self.rank) or self._state()
        entries = _entries()
        hung = entries[-1] if entries else None
        limit = f"distributed.timeout_minutes={self.timeout_minutes:g} ({self.timeout_minutes * 60:.0f} s)"
        if hung is None:
            return [f"hang at step {self.step}: a collective did not complete within {limit} on rank {self.rank} "
                    f"({first}); no flight record here (TORCH_FR_BUFFER_SIZE=0?)"]
        group, seq = str(hung["process_group"][0]), hung["collective_seq_id"]
        axis, ranks = self.axes.get(group, (f"group {group}", sorted(answers)))
        step = self.step_at(hung.get("time_created_ns") or 0) or mine["step"]
        entered = [r for r in ranks if r in answers and answers[r]["last"].get(group, {}).get("seq", 0) >= seq]
        missing = [r for r in ranks if r not in entered]
        out = [f"hang at step {step}: {hung.get('profiling_name', 'a collective')} #{seq} on mesh axis {axis} "
               f"(ranks {ranks}) did not complete within {limit}",
               f"  entered: ranks {entered}; not entered: ranks {missing}"]
        for r in missing:
            a = answers.get(r)
            if a is None:
                out.append(f"  rank {r}: no answer within {ANSWER_S:.0f} s (its process is gone, or its Python "
                           "holds the interpreter lock)")
                continue
            last = a["last"].get(group)
            where = f"its last collective there #{last['seq']} {last['op']} at step {last['step']}" if last else \
                "it never entered a collective of this group"
            out.append(f"  rank {r} is at step {a['step']} ({where}), in:")
            out += [f"    {ln}" for ln in a["stack"].rstrip().splitlines()]
        return out


def _has(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001
        return False
