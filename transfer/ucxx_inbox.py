"""Target side of the ucxx data plane: headers in, page receives posted into the pool, notifs out.

Driven by ``UcxxTransport.poll_notifs`` under the transport's lock (one UCX worker, no progress
thread). Each call: progress the worker, take every header that arrived (tag 0), post one receive
per page straight into the destination pool page, and deliver the notification of every write
whose page receives all completed, in header order per initiator connection.

A header read after its write's deadline (the initiator has aborted it, or is about to) gets its
page receives posted into a scratch page instead of the pool, so a late rendezvous can never land
in pages the decode worker may already have reused; that write's notif is not delivered.

A header naming ``lanes`` > 0 has its page receives posted by the copy lanes instead
(``transfer/ucxx_lanes.py``: page ``i`` on lane ``i % lanes``, each lane a UCX worker with its own
thread); the write completes when every lane's part ended and its notif is delivered here, in the
same order as the others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from transfer.kv_transport import has_duplicates
from transfer.ucxx_lanes import CopyLane, LaneJob, first_error
from transfer.ucxx_wire import HEADER_TAG, WriteHeader, page_lane, page_tag, unpack_header

log = logging.getLogger(__name__)

#: Headers read later than ``deadline - LATE_GUARD_S`` are drained into scratch (see module doc).
LATE_GUARD_S = 0.5


@dataclass
class _Inbound:
    header: WriteHeader
    reqs: list  # receives on the main worker
    deliver: bool
    lane_parts: int = 0  # copy-lane jobs not ended yet
    lane_error: str | None = None

    def complete(self) -> bool:
        return self.lane_parts == 0 and all(r.completed for r in self.reqs)


class Inbox:
    """Receives writes into ``pages`` (uint8 ``[num_pages, page_bytes]`` view of the pool), on the
    main ``worker`` and on ``lanes`` (which it closes in ``close``)."""

    def __init__(self, ucx, array_type, worker, pages: np.ndarray, lanes: list[CopyLane] | None = None) -> None:
        self._ucx, self._array, self._worker = ucx, array_type, worker
        self._pages = pages
        self.lanes = list(lanes or [])
        self._scratch = np.empty(pages.shape[1], dtype=np.uint8)
        self._lane_scratch = [np.empty(pages.shape[1], dtype=np.uint8) for _ in self.lanes]
        self._headers: deque[tuple[object, np.ndarray]] = deque()
        self._by_conn: dict[int, deque[_Inbound]] = {}
        self.drained = 0  # writes whose pages went to scratch (late or malformed)
        self.lane_writes = 0  # writes whose pages came over the copy lanes

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
        ok = pages.size == 0 or (pages.min() >= 0 and pages.max() < n and not has_duplicates(pages))
        late = time.time() >= h.deadline - LATE_GUARD_S
        if h.lanes > len(self.lanes):  # the initiator sent pages to workers this target lacks
            log.error(
                "ucxx write %d from %s names %d copy lanes, this target has %d: dropped",
                h.seq,
                h.sender,
                h.lanes,
                len(self.lanes),
            )
            self.drained += 1
            return
        if not ok:
            log.error("ucxx write %d from %s names pages outside this pool (%d pages): drained", h.seq, h.sender, n)
        elif late:
            log.warning("ucxx write %d from %s arrived after its deadline: drained, not delivered", h.seq, h.sender)
        deliver = ok and not late
        self.drained += not deliver
        inbound = _Inbound(h, [], deliver)
        if h.lanes:
            self._post_lanes(h, inbound)
        else:
            u = self._ucx
            inbound.reqs = [
                self._worker.tag_recv(
                    self._array(self._pages[int(d)] if deliver else self._scratch),
                    u.UCXXTag(page_tag(h.conn_id, h.seq, i)),
                    u.UCXXTagMaskFull,
                )
                for i, d in enumerate(pages)
            ]
        self._by_conn.setdefault(h.conn_id, deque()).append(inbound)

    def _post_lanes(self, h: WriteHeader, inbound: _Inbound) -> None:
        """One job per lane that carries pages of this write (page i on lane i % h.lanes)."""
        jobs: dict[int, LaneJob] = {}
        for i, d in enumerate(h.dst_pages.tolist()):
            k = page_lane(i, h.lanes)
            job = jobs.get(k) or jobs.setdefault(k, LaneJob((h.conn_id, h.seq), [], [], h.deadline))
            job.bufs.append(self._pages[d] if inbound.deliver else self._lane_scratch[k])
            job.tags.append(page_tag(h.conn_id, h.seq, i))
        inbound.lane_parts = len(jobs)
        self.lane_writes += 1
        log.debug("ucxx write %d from %s: %d pages on %d copy lanes", h.seq, h.sender, h.dst_pages.size, len(jobs))
        for k, job in jobs.items():
            self.lanes[k].submit(job)

    def _take_lane_results(self) -> None:
        """Count every ended lane job against its write (matched by connection and sequence)."""
        for lane in self.lanes:
            for (conn_id, seq), error in lane.take_done():
                for w in self._by_conn.get(conn_id, ()):
                    if w.header.seq == seq and w.lane_parts:
                        w.lane_parts -= 1
                        w.lane_error = w.lane_error or error
                        break

    def _collect(self) -> list[tuple[str, bytes]]:
        self._take_lane_results()
        out: list[tuple[str, bytes]] = []
        for conn_id, queue in list(self._by_conn.items()):
            while queue and queue[0].complete():
                w = queue.popleft()
                error = w.lane_error or first_error(w.reqs)
                if error is not None:
                    log.warning(
                        "ucxx write %d from %s failed on the target side: %s", w.header.seq, w.header.sender, error
                    )
                elif w.deliver:
                    out.append((w.header.sender, w.header.notif))
            if not queue:
                del self._by_conn[conn_id]
        return out

    def pending(self) -> int:
        """Writes whose header arrived but whose pages are not all in yet."""
        return sum(len(q) for q in self._by_conn.values())

    def close(self) -> None:
        """Stop the copy lanes (their pending receives cancelled)."""
        for lane in self.lanes:
            lane.close()
