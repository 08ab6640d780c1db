"""``KVTransport`` over ucxx (``ucxx-cu12``, ucx-py's successor): tagged page messages + header.

ucxx's Python API has no RMA (no memory handles or remote keys), so a one-sided write is built
from tagged messages (wire format and tags: ``transfer/ucxx_wire.py``): the initiator sends a
header (destination page ids, notif, deadline) and one message per source page; the target posts
each page's receive straight into the destination page of its registered pool when the header
arrives (``transfer/ucxx_inbox.py``) and delivers the notif once all of them completed. Pages are
large enough for UCX's rendezvous protocol, so on one host each page moves in a single cma copy
from the prefill pool into the decode pool, with no staging buffer on either side.

Differences from the NIXL backend a caller can see:

* The target does the copy inside its ``poll_notifs`` (it pulls the data); the initiator's handle
  turns ``"done"`` when every message left (``poll`` progresses the initiator's worker). ``done``
  means the source pages may be reused and the target will deliver the notif only after every
  page is in its pool.
* Every write has a deadline, ``write_timeout_s`` after it started. A write still pending then is
  reported ``"error"`` and its connection is aborted (``close_blocking``, ucxx's abort); the next
  write to that peer reconnects. With endpoint error handling off a send to a dead peer never
  completes, so this deadline is how a dead peer is detected; with it on UCX reports the failure
  itself (sub-millisecond on loopback) and the deadline only catches a live peer that stopped
  polling. A target reads a header after its deadline only into scratch memory.
* ``error_handling``: ``False`` (default) lets UCX use shared memory/cma on one host; ``True``
  (UCX's peer error handling) excludes those transports and falls back to TCP. Measured here
  (``pdserve bench transfer --backend ucxx --ucxx-error-handling both``): see the issue-15 note.
* Host (DRAM) pools only; a CUDA pool raises ``ValueError`` (use NIXL there).
* No sends on an endpoint UCX reported failed (error handling on: the endpoint's ``alive``): a
  write progresses the worker once after its header and, if the peer is gone, fails and aborts
  the connection without posting its pages; the next write replaces a failed connection. UCX
  1.21 segfaults when a rendezvous page send fails at once on a dead peer in a context without a
  registration cache (``UCX_RCACHE_ENABLE=n``, or NIXL's UCX copy set up first in the process).

One UCX context and worker per transport, no progress thread (on 2 cores ucxx's thread competes
with the scheduler): progress happens inside ``write_pages``, ``TransferHandle.poll``,
``poll_notifs`` and ``close``, serialized by one lock.
"""
from __future__ import annotations

import base64
import logging
import secrets
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.kv_transport import CompletedHandle, TransferHandle
from transfer.transport_base import PeerRecord, PendingHandle, RemoteTransportBase, err_text, peer_pool_size
from transfer.ucxx_inbox import Inbox, first_error
from transfer.ucxx_wire import HEADER_TAG, MAX_PAGES_PER_WRITE, WriteHeader, pack_header, page_tag

log = logging.getLogger(__name__)

#: How long ``close_blocking`` may wait for UCX's endpoint teardown (ns).
_ABORT_PERIOD_NS = 100_000_000


def _ucxx():
    """``(ucxx._lib.libucxx, ucxx._lib.arr.Array)``; ``RuntimeError`` saying how to install it."""
    try:
        import ucxx._lib.libucxx as ucx
        from ucxx._lib.arr import Array
    except Exception as e:  # ImportError or a broken native library
        raise RuntimeError(f"the ucxx backend needs ucxx-cu12 (pip install 'pdserve[ucxx]'): {e}") from None
    return ucx, Array


@dataclass(eq=False)
class _Conn:
    """One endpoint to a peer. Its tags carry ``conn_id``; a reconnect gets a new one."""

    ep: object
    conn_id: int
    seq: int = 0
    handles: "weakref.WeakSet[UcxxHandle]" = field(default_factory=weakref.WeakSet)
    keep: list = field(default_factory=list)  # requests + buffers of writes aborted on this conn


@dataclass
class _Peer(PeerRecord):
    """A peer's UCX worker address and, once written to, its connection."""

    address: bytes
    conn: _Conn | None = None


class UcxxHandle(PendingHandle):
    """The header and page sends of one write. ``poll`` progresses the worker."""

    def __init__(self, transport: "UcxxTransport", conn: _Conn, reqs: list, header: np.ndarray,
                 deadline: float) -> None:
        super().__init__(transport)
        self._conn, self._reqs, self._header = conn, reqs, header
        self._deadline = deadline

    def _advance(self) -> None:
        t = self._transport
        t._progress()
        if all(r.completed for r in self._reqs):
            error = first_error(self._reqs)
            if error is None:
                self._state = "done"
                self._conn.handles.discard(self)
            else:
                t._abort_conn(self._conn, f"UCX reported the write failed: {error}")
        elif time.monotonic() >= self._deadline:
            t._abort_conn(self._conn, f"no completion within write_timeout_s={t.write_timeout_s:g}s "
                                      "(peer dead, or alive but not polling): connection aborted")

    def _on_fail(self) -> None:
        self._conn.keep.extend((self._reqs, self._header))  # UCX may still hold the buffers

    def _release_resources(self) -> None:
        """A pending write cannot be cancelled on its own in ucxx: it is reported failed and runs
        out (or is aborted with its connection at the deadline / on ``close``)."""
        self._conn.handles.discard(self)


class UcxxTransport(RemoteTransportBase):
    """ucxx implementation of ``KVTransport`` for host-memory pools."""

    backend = "ucxx"
    poll_interval_s = 0.0  # rendezvous sends and receives move only inside our progress calls

    def __init__(self, name: str, *, error_handling: bool = False, write_timeout_s: float = 8.0) -> None:
        super().__init__(name)
        if len(name.encode()) > 255:
            raise ValueError("ucxx transport names are at most 255 bytes")
        if not write_timeout_s > 0:
            raise ValueError(f"write_timeout_s must be > 0, got {write_timeout_s!r}")
        self._ucx, self._array = _ucxx()
        self.error_handling = bool(error_handling)
        self.write_timeout_s = float(write_timeout_s)
        self._dead: list[_Conn] = []
        self._pages: np.ndarray | None = None
        self._inbox: Inbox | None = None
        self._context = self._ucx.UCXContext(feature_flags=(self._ucx.Feature.TAG,))
        self._worker = self._ucx.UCXWorker(self._context)

    # ---- setup --------------------------------------------------------------------------------
    def _register(self, buffer: torch.Tensor, page_bytes: int, num_pages: int, length: int,
                  mem_type: str, dev: int) -> None:
        if mem_type != "DRAM":
            raise ValueError("the ucxx backend moves host-memory pools only; use --transfer-backend nixl "
                             f"for a pool on {buffer.device}")
        pages = buffer.view(-1).view(torch.uint8).numpy().reshape(num_pages, page_bytes)
        self._inbox = Inbox(self._ucx, self._array, self._worker, pages)
        self._pages = pages

    def _metadata_extra(self) -> dict:
        address = self._worker.address.tobytes()
        return {"error_handling": self.error_handling, "ucx_address": base64.b64encode(address).decode("ascii")}

    def _parse_peer(self, name: str, md: dict) -> tuple[int, int, bytes]:
        page_bytes, num_pages = peer_pool_size(name, md)
        try:
            address = base64.b64decode(md["ucx_address"], validate=True)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"peer {name!r} metadata: missing or bad ucx_address ({e})") from None
        return page_bytes, num_pages, address

    def _connect_peer(self, name: str, raw: bytes, md: dict, page_bytes: int, num_pages: int,
                      blob: bytes) -> _Peer:
        return _Peer(name, raw, num_pages, page_bytes, blob)  # connects on its first write

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """Forget the peer and abort its connection: its pending writes fail with ``why``."""
        self._peers.pop(peer.name, None)
        if peer.conn is not None:
            self._abort_conn(peer.conn, why)

    # ---- connections --------------------------------------------------------------------------
    def _connect(self, peer: _Peer) -> _Conn:
        """The peer's connection; a new one if it has none or UCX reported its endpoint failed."""
        if peer.conn is not None and not peer.conn.ep.alive:
            self._abort_conn(peer.conn, "UCX reported the connection failed (peer gone)")
        if peer.conn is None:
            u = self._ucx
            addr = u.UCXAddress.create_from_buffer(np.frombuffer(peer.address, dtype=np.uint8))
            ep = self._worker.create_endpoint_from_worker_address(addr, self.error_handling)
            conn_id = 0
            while conn_id == HEADER_TAG:
                conn_id = secrets.randbits(32)
            peer.conn = _Conn(ep, conn_id)
        return peer.conn

    def _abort_conn(self, conn: _Conn, why: str) -> None:
        """Fail every pending write on ``conn`` with ``why`` and abort its endpoint (idempotent)."""
        for h in list(conn.handles):
            h._fail(why)
        conn.handles.clear()
        for p in self._peers.values():
            if p.conn is conn:
                p.conn = None
        if conn.ep is not None:
            try:
                conn.ep.close_blocking(period=_ABORT_PERIOD_NS, max_attempts=1)
            except Exception as e:  # noqa: BLE001 - the endpoint is already broken
                log.debug("aborting a ucxx endpoint: %s", err_text(e))
            self._dead.append(conn)  # its requests may still reference their buffers
            conn.ep = None

    def _progress(self) -> None:
        try:
            self._worker.progress()
        except Exception as e:  # noqa: BLE001 - failures surface in the requests
            log.debug("ucxx progress: %s", err_text(e))

    # ---- data path ----------------------------------------------------------------------------
    def _write(self, peer: _Peer, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        if src.size > MAX_PAGES_PER_WRITE:
            raise ValueError(f"a ucxx write carries at most {MAX_PAGES_PER_WRITE} pages, got {src.size}")
        try:
            conn = self._connect(peer)
        except Exception as e:  # noqa: BLE001 - reported through the handle, never raised
            return CompletedHandle(error=f"could not connect to {peer.name!r}: {err_text(e)}")
        return self._post(conn, src, dst, notif)

    def _post(self, conn: _Conn, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        u, seq = self._ucx, conn.seq
        conn.seq = (conn.seq + 1) & 0xFFFF
        deadline = time.monotonic() + self.write_timeout_s
        header = pack_header(WriteHeader(self.name, conn.conn_id, seq, dst, notif,
                                         time.time() + self.write_timeout_s))
        reqs: list = []
        handle = UcxxHandle(self, conn, reqs, header, deadline)
        conn.handles.add(handle)
        try:
            reqs.append(conn.ep.tag_send(self._array(header), u.UCXXTag(HEADER_TAG)))
            self._progress()  # lets UCX report a peer the header found dead (error handling on)
            if not conn.ep.alive:  # no page sends on a failed endpoint (see the module docstring)
                self._abort_conn(conn, "UCX reported the connection failed (peer gone)")
                return handle
            for i, s in enumerate(src.tolist()):
                reqs.append(conn.ep.tag_send(self._array(self._pages[s]), u.UCXXTag(page_tag(conn.conn_id, seq, i))))
        except Exception as e:  # noqa: BLE001 - a broken endpoint: fail this write, reconnect next time
            self._abort_conn(conn, f"could not post the write: {err_text(e)}")
            return handle
        self._progress()
        return handle

    def _take_notifs(self) -> list[tuple[str, bytes]]:
        if self._inbox is None:
            self._progress()
            return []
        return self._inbox.pump()

    def _teardown(self) -> None:
        for p in list(self._peers.values()):
            self._drop_peer(p, "transport closed before the write completed")
        try:
            self._worker.cancel_inflight_requests()
            self._worker.progress()
        except Exception as e:  # noqa: BLE001
            log.debug("cancelling ucxx requests on close: %s", err_text(e))
        self._inbox = None
        self._pages = None
