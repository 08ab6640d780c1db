"""The KV writing thread (``prefill_worker.kv_writer.KVWriter``): posting order and hand-over."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from prefill_worker.kv_writer import KVWriter
from transfer.kv_transport import TransferHandle

PAGES = np.arange(2, dtype=np.int32)


class _Handle(TransferHandle):
    def __init__(self, done: threading.Event) -> None:
        self.done, self.released = done, False

    def poll(self):
        return "done" if self.done.is_set() else "pending"

    def release(self) -> None:
        self.released = True


class _Transport:
    """Writes that end when their event is set; ``notifies_on_poll`` like NIXL."""

    notifies_on_poll = True

    def __init__(self) -> None:
        self.posted: list[bytes] = []
        self.events: dict[bytes, threading.Event] = {}

    def write_pages(self, peer, src, dst, notif):
        if notif == b"bad":
            raise ValueError("unknown peer")
        self.posted.append(notif)
        return _Handle(self.events.setdefault(notif, threading.Event()))


@contextmanager
def _writer(t: _Transport, settle_s: float):
    w = KVWriter(t, settle_s=settle_s)
    try:
        yield w
    finally:
        w.close()


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def test_a_batch_of_writes_is_posted_before_any_is_waited_on():
    """Three writes submitted together are all posted while the first is still pending in its
    settle window (before: each waited up to the window for the one before it)."""
    t = _Transport()
    with _writer(t, 30.0) as w:
        futures = [w.submit("d", PAGES, PAGES, n) for n in (b"a", b"b", b"c")]
        assert _wait_for(lambda: len(t.posted) == 3, timeout=2.0), t.posted
        assert t.posted == [b"a", b"b", b"c"] and not any(f.done() for f in futures)
        t.events[b"b"].set()
        handle, ended_at = futures[1].result(2)
        assert handle.poll() == "done" and ended_at is not None and not futures[0].done()
        t.events[b"a"].set()
        t.events[b"c"].set()
        assert all(f.result(2)[1] is not None for f in futures)


def test_a_write_still_pending_at_its_deadline_is_handed_over_unended():
    t = _Transport()
    with _writer(t, 0.02) as w:
        handle, ended_at = w.submit("d", PAGES, PAGES, b"slow").result(2)
        assert ended_at is None and handle.poll() == "pending" and not handle.released


def test_a_write_that_cannot_start_fails_its_future_only():
    t = _Transport()
    with _writer(t, 30.0) as w:
        bad, good = w.submit("d", PAGES, PAGES, b"bad"), w.submit("d", PAGES, PAGES, b"ok")
        with pytest.raises(ValueError, match="unknown peer"):
            bad.result(2)
        t.events[b"ok"].set()
        assert good.result(2)[1] is not None


def test_close_hands_every_write_over_and_stops_the_thread():
    t = _Transport()
    w = KVWriter(t, settle_s=30.0)
    f = w.submit("d", PAGES, PAGES, b"x")
    w.close()
    assert f.result(0)[1] is None and not w._thread.is_alive()


def test_a_transport_that_notifies_with_the_data_is_not_waited_on():
    t = _Transport()
    t.notifies_on_poll = False
    with _writer(t, 30.0) as w:
        handle, ended_at = w.submit("d", PAGES, PAGES, b"x").result(2)
        assert ended_at is None and handle.poll() == "pending"
