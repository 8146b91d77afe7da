"""The hang watch thread (distributed/hang.py) and the rendezvous store: while nothing hangs, a rank costs the one
TCPStore of the job 1 / WATCH_WAIT_S requests a second (one server-side `wait`, renewed), not one a second as when
it polled (16,384 requests a second at 16,384 ranks); when the reporting rank rings, it answers at once; `stop`
leaves no thread in a store call. Counted by a wrapper around a real TCPStore client."""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

from meshforge.distributed import hang


class Counting:
    """A store client that counts the requests it sends."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)
        return call


class Answer:
    def state(self) -> dict:
        return {"rank": 3, "step": 7}


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def _watch(store, rank: int, seconds: float) -> list[str]:
    hang._Watch.start(rank, store_factory=lambda **_: store)
    time.sleep(seconds)
    return list(store.calls)


def test_the_watch_waits_on_the_store_instead_of_polling_and_answers_when_rung(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setattr(hang, "_REC", Answer())
    window = 1.0
    try:
        # the real renewal period: one request to clear this rank's key, one wait, nothing more in the window
        store = Counting(_client(server))
        calls = _watch(store, 3, window)
        print(f"WATCH_WAIT_S={hang.WATCH_WAIT_S:g}: {len(calls)} store requests in {window:g} s ({calls}); the "
              f"polling thread made one a second")
        assert calls == ["delete_key", "wait"], calls
        hang._Watch.stop(store_factory=lambda **_: _client(server))
        assert hang._Watch._thread is None

        # a short renewal period shows the rate: 1 / WATCH_WAIT_S requests a second
        monkeypatch.setattr(hang, "WATCH_WAIT_S", 0.25)
        store = Counting(_client(server))
        waits = _watch(store, 3, window).count("wait")
        print(f"WATCH_WAIT_S=0.25: {waits} waits in {window:g} s")
        assert window / 0.25 / 2 <= waits <= window / 0.25 + 1, waits

        # the reporting rank rings: the answer is there within a second
        asker = _client(server)
        t0 = time.perf_counter()
        asker.set(hang._bell(3), "ask")
        asker.wait([f"{hang._prefix()}rank3"], datetime.timedelta(seconds=5))
        print(f"answered in {time.perf_counter() - t0:.3f} s")
        assert time.perf_counter() - t0 < 1.0
        assert json.loads(asker.get(f"{hang._prefix()}rank3")) == Answer().state()
    finally:
        hang._Watch.stop(store_factory=lambda **_: _client(server))
    assert hang._Watch._thread is None
