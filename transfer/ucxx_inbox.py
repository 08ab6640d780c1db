"""Target side of the ucxx data plane: headers in, page receives posted into the pool, notifs out.

Driven by ``UcxxTransport.poll_notifs`` under the transport's lock (one UCX worker, no progress
thread). Each call: progress the worker, take every header that arrived (tag 0), post one receive
per page straight into the destination pool page, and deliver the notification of every write
whose page receives all completed, in header order per initiator connection.

A header read after its write's deadline (the initiator has aborted it, or is about to) gets its
page receives posted into a scratch page instead of the pool, so a late rendezvous can never land
in pages the decode worker may already have reused; that write's notif is not delivered.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from transfer.ucxx_wire import HEADER_TAG, WriteHeader, page_tag, unpack_header

log = logging.getLogger(__name__)

#: Headers read later than ``deadline - LATE_GUARD_S`` are drained into scratch (see module doc).
LATE_GUARD_S = 0.5


@dataclass
class _Inbound:
    header: WriteHeader
    reqs: list
    deliver: bool


class Inbox:
    """Receives writes into ``pages`` (uint8 ``[num_pages, page_bytes]`` view of the pool)."""

    def __init__(self, ucx, array_type, worker, pages: np.ndarray) -> None:
        self._ucx, self._array, self._worker = ucx, array_type, worker
        self._pages = pages
        self._scratch = np.empty(pages.shape[1], dtype=np.uint8)
        self._headers: deque[tuple[object, np.ndarray]] = deque()
        self._by_conn: dict[int, deque[_Inbound]] = {}
        self.drained = 0  # writes whose pages went to scratch (late or malformed)

    def pump(self) -> list[tuple[str, bytes]]:
        """Progress, post receives for new headers, return notifs of completed writes."""
        self._worker.progress()
        self._take_headers()
        self._post_ready_headers()
        self._worker.progress()
        return self._collect()

    def _take_headers(self) -> None:
        u = self._ucx
        while True:
            probe = self._worker.tag_probe(u.UCXXTag(HEADER_TAG), u.UCXXTagMaskFull, remove=True)
            if not probe.matched:
                return
            buf = np.empty(probe.length, dtype=np.uint8)
            self._headers.append((self._worker.tag_recv_with_handle(self._array(buf), probe), buf))

    def _post_ready_headers(self) -> None:
        while self._headers and self._headers[0][0].completed:
            req, buf = self._headers.popleft()
            try:
                req.check_error()
                header = unpack_header(buf.tobytes())
            except Exception as e:  # noqa: BLE001 - a bad header only loses that write
                log.error("dropping a ucxx header: %s", e)
                continue
            self._post(header)

    def _post(self, h: WriteHeader) -> None:
        pages = h.dst_pages
        n = self._pages.shape[0]
        ok = pages.size == 0 or (pages.min() >= 0 and pages.max() < n and np.unique(pages).size == pages.size)
        late = time.time() >= h.deadline - LATE_GUARD_S
        if not ok:
            log.error("ucxx write %d from %s names pages outside this pool (%d pages): drained",
                      h.seq, h.sender, n)
        elif late:
            log.warning("ucxx write %d from %s arrived after its deadline: drained, not delivered",
                        h.seq, h.sender)
        deliver = ok and not late
        self.drained += not deliver
        u = self._ucx
        reqs = [self._worker.tag_recv(self._array(self._pages[int(d)] if deliver else self._scratch),
                                      u.UCXXTag(page_tag(h.conn_id, h.seq, i)), u.UCXXTagMaskFull)
                for i, d in enumerate(pages)]
        self._by_conn.setdefault(h.conn_id, deque()).append(_Inbound(h, reqs, deliver))

    def _collect(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for conn_id, queue in list(self._by_conn.items()):
            while queue and all(r.completed for r in queue[0].reqs):
                w = queue.popleft()
                error = first_error(w.reqs)
                if error is not None:
                    log.warning("ucxx write %d from %s failed on the target side: %s",
                                w.header.seq, w.header.sender, error)
                elif w.deliver:
                    out.append((w.header.sender, w.header.notif))
            if not queue:
                del self._by_conn[conn_id]
        return out

    def pending(self) -> int:
        """Writes whose header arrived but whose pages are not all in yet."""
        return sum(len(q) for q in self._by_conn.values())


def first_error(reqs) -> str | None:
    """The first failed request's error as text, or None when all succeeded."""
    for r in reqs:
        try:
            r.check_error()
        except Exception as e:  # noqa: BLE001 - UCXX*Error: the peer died mid-write
            return f"{type(e).__name__}: {e}"
    return None
