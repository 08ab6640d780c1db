"""Copy lanes of the ucxx target: extra UCX workers, each owned by one thread, that pull pages.

With ucxx the target does a write's copy (UCX's rendezvous get: on one host one ``process_vm_readv``
per page, inside the receiving worker's progress). One worker is one copy stream, and on a decode
worker that stream only moves while the worker loop polls. A lane is a second UCX worker with its
own thread: an initiator that splits a write's pages over the target's lanes (page ``i`` on lane
``i % lanes``, the header names the count: ``transfer/ucxx_wire.py``) gets that many copies in
parallel (ucxx's ``progress`` releases the GIL), and they move while the worker loop computes.

Contract:

* Every UCX call on a lane's worker happens on the lane's thread; other threads only ``submit``
  jobs and ``take_done`` results, through thread-safe queues. Each lane has its own UCX context:
  ucxx creates contexts without ``mt_workers_shared``, so workers of one context must not be
  driven from several threads.
* A job is the page receives of one write on this lane. It ends ``done`` (every receive completed;
  ``error`` is the first failure's text or ``None``). A job's buffers must stay valid until it ends.
* With receives pending the thread progresses without sleeping (the copies are its work); once
  every pending job is past its deadline it progresses every ``LATE_POLL_S`` (a dead initiator's
  sends never complete). Idle, it blocks on its queue: no CPU.
* ``close`` stops the thread after cancelling the worker's pending receives; jobs still pending
  end with an error. Idempotent.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

#: A lane whose every pending job is past its deadline progresses this often (seconds).
LATE_POLL_S = 0.005


@dataclass
class LaneJob:
    """The receives of one write on one lane: ``bufs[j]`` gets the message tagged ``tags[j]``."""

    key: tuple[int, int]  # (conn_id, seq) of the write
    bufs: list[np.ndarray]
    tags: list[int]
    deadline: float  # time.time() after which the initiator has given the write up
    reqs: list | None = None


_STOP = object()


class CopyLane:
    """One UCX context and worker and the thread that posts and progresses its receives."""

    def __init__(self, ucx, array_type, name: str) -> None:
        self._ucx, self._array = ucx, array_type
        self._context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG,))
        self._worker = ucx.UCXWorker(self._context)
        self.address: bytes = self._worker.address.tobytes()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[tuple[tuple[int, int], str | None]] = deque()
        self._pending: list[LaneJob] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: LaneJob) -> None:
        """Hand ``job`` to the lane's thread (it posts the receives there)."""
        if self._closed:
            raise RuntimeError("copy lane is closed")
        self._jobs.put(job)

    def take_done(self) -> list[tuple[tuple[int, int], str | None]]:
        """``(key, error or None)`` of every job that ended since the last call."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        """Stop the thread (pending receives cancelled, their jobs ended with an error)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        self._thread.join(10)
        if self._thread.is_alive():
            log.error("ucxx copy lane %s did not stop within 10 s", self._thread.name)

    # ---- the lane's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:  # noqa: BLE001 - a lane must never die silently
            log.exception("ucxx copy lane %s failed", self._thread.name)
            self._end_all("copy lane failed")

    def _step(self) -> bool:
        """Take new jobs (blocking when idle), progress, end completed jobs; False to stop."""
        job = self._jobs.get() if not self._pending else self._next_nowait()
        while job is not None:
            if job is _STOP:
                self._stop()
                return False
            self._post(job)
            job = self._next_nowait()
        self._worker.progress()
        self._reap()
        if self._pending and time.time() >= max(j.deadline for j in self._pending):
            time.sleep(LATE_POLL_S)
        return True

    def _next_nowait(self):
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            return None

    def _post(self, job: LaneJob) -> None:
        u = self._ucx
        try:
            job.reqs = [
                self._worker.tag_recv(self._array(b), u.UCXXTag(t), u.UCXXTagMaskFull)
                for b, t in zip(job.bufs, job.tags)
            ]
        except Exception as e:  # noqa: BLE001 - only this write is lost
            self._done.append((job.key, f"could not post the receives: {type(e).__name__}: {e}"))
            return
        self._pending.append(job)

    def _reap(self) -> None:
        still = []
        for job in self._pending:
            if all(r.completed for r in job.reqs):
                self._done.append((job.key, first_error(job.reqs)))
            else:
                still.append(job)
        self._pending = still

    def _stop(self) -> None:
        try:
            self._worker.cancel_inflight_requests()
            self._worker.progress()
        except Exception as e:  # noqa: BLE001 - closing anyway
            log.debug("cancelling a copy lane's receives: %s", e)
        self._end_all("transport closed before the write completed")

    def _end_all(self, why: str) -> None:
        for job in self._pending:
            self._done.append((job.key, why))
        self._pending = []


def first_error(reqs) -> str | None:
    """The first failed request's error as text, or None when all succeeded."""
    for r in reqs:
        try:
            r.check_error()
        except Exception as e:  # noqa: BLE001 - UCXX*Error: the peer died mid-write
            return f"{type(e).__name__}: {e}"
    return None
