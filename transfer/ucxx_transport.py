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

One UCX context and worker per transport, no progress thread (on 2 cores ucxx's thread competes
with the scheduler): progress happens inside ``write_pages``, ``TransferHandle.poll``,
``poll_notifs`` and ``close``, serialized by one lock.
"""
from __future__ import annotations

import base64
import logging
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.kv_transport import (CompletedHandle, KVTransport, TransferHandle, TransferState, check_notif,
                                   check_pages, decode_metadata, device_of, encode_metadata, pool_geometry)
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


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass(eq=False)
class _Conn:
    """One endpoint to a peer. Its tags carry ``conn_id``; a reconnect gets a new one."""

    ep: object
    conn_id: int
    seq: int = 0
    handles: "weakref.WeakSet[UcxxHandle]" = field(default_factory=weakref.WeakSet)
    keep: list = field(default_factory=list)  # requests + buffers of writes aborted on this conn


@dataclass
class _Peer:
    name: str
    raw: bytes
    num_pages: int
    page_bytes: int
    address: bytes
    conn: _Conn | None = None


class UcxxHandle(TransferHandle):
    """The header and page sends of one write. ``poll`` progresses the worker."""

    def __init__(self, transport: "UcxxTransport", conn: _Conn, reqs: list, header: np.ndarray,
                 deadline: float) -> None:
        self._t, self._conn, self._reqs, self._header = transport, conn, reqs, header
        self._deadline = deadline
        self._state: TransferState = "pending"
        self.error = None

    def poll(self) -> TransferState:
        if self._state != "pending":
            return self._state
        t = self._t
        with t._lock:
            if self._state != "pending":
                return self._state
            if t._closed:
                self._fail("transport closed before the write completed")
                return self._state
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
        return self._state

    def _fail(self, why: str) -> None:
        if self._state == "pending":
            self._state, self.error = "error", why
            self._conn.keep.extend((self._reqs, self._header))  # UCX may still hold the buffers

    def release(self) -> None:
        """A pending write cannot be cancelled on its own in ucxx: it is reported failed and runs
        out (or is aborted with its connection at the deadline / on ``close``)."""
        with self._t._lock:
            if self._state == "pending":
                self._fail("released before completion")
            self._conn.handles.discard(self)


class UcxxTransport(KVTransport):
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
        self._lock = threading.RLock()
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._dead: list[_Conn] = []
        self._buffer: torch.Tensor | None = None
        self._pages: np.ndarray | None = None
        self._inbox: Inbox | None = None
        self._page_bytes = self._num_pages = 0
        self._context = self._ucx.UCXContext(feature_flags=(self._ucx.Feature.TAG,))
        self._worker = self._ucx.UCXWorker(self._context)

    # ---- setup --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")

    def register_pool(self, buffer: torch.Tensor, page_bytes: int) -> None:
        with self._lock:
            self._check_open()
            if self._buffer is not None:
                raise RuntimeError(f"transport {self.name!r} already has a registered pool")
            num_pages, _ = pool_geometry(buffer, page_bytes)
            if device_of(buffer)[0] != "DRAM":
                raise ValueError("the ucxx backend moves host-memory pools only; use --transfer-backend nixl "
                                 f"for a pool on {buffer.device}")
            self._pages = buffer.view(-1).view(torch.uint8).numpy().reshape(num_pages, int(page_bytes))
            self._buffer, self._page_bytes, self._num_pages = buffer, int(page_bytes), num_pages
            self._inbox = Inbox(self._ucx, self._array, self._worker, self._pages)

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._buffer is None:
                raise RuntimeError("register_pool before local_metadata")
            address = self._worker.address.tobytes()
            return encode_metadata({
                "backend": self.backend, "name": self.name, "mem_type": "DRAM", "device": 0,
                "base": self._buffer.data_ptr(), "length": self._num_pages * self._page_bytes,
                "page_bytes": self._page_bytes, "num_pages": self._num_pages,
                "error_handling": self.error_handling,
                "ucx_address": base64.b64encode(address).decode("ascii"),
            })

    def add_peer(self, peer_metadata: bytes) -> str:
        raw = bytes(peer_metadata)
        md = decode_metadata(raw, self.backend)
        name = str(md["name"])
        page_bytes, num_pages = int(md["page_bytes"]), int(md["num_pages"])
        if page_bytes <= 0 or num_pages <= 0:
            raise ValueError(f"peer {name!r} has an empty pool ({num_pages} pages of {page_bytes} bytes)")
        try:
            address = base64.b64decode(md["ucx_address"], validate=True)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"peer {name!r} metadata: missing or bad ucx_address ({e})") from None
        with self._lock:
            self._check_open()
            if name == self.name:
                raise ValueError(f"peer metadata is this transport's own ({name!r})")
            if self._buffer is not None and page_bytes != self._page_bytes:
                raise ValueError(f"peer {name!r} has page_bytes={page_bytes}, local pool has {self._page_bytes}")
            old = self._peers.get(name)
            if old is not None:
                if old.raw == raw:
                    return name
                self._drop_peer(old, f"peer {name!r} restarted")
            self._peers[name] = _Peer(name, raw, num_pages, page_bytes, address)
            return name

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        self._peers.pop(peer.name, None)
        if peer.conn is not None:
            self._abort_conn(peer.conn, why)

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and not self._closed:
                self._drop_peer(peer, f"peer {name!r} removed")

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ---- connections --------------------------------------------------------------------------
    def _connect(self, peer: _Peer) -> _Conn:
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
                log.debug("aborting a ucxx endpoint: %s", _err(e))
            self._dead.append(conn)  # its requests may still reference their buffers
            conn.ep = None

    def _progress(self) -> None:
        try:
            self._worker.progress()
        except Exception as e:  # noqa: BLE001 - failures surface in the requests
            log.debug("ucxx progress: %s", _err(e))

    # ---- data path ----------------------------------------------------------------------------
    def write_pages(self, peer: str, src_pages: np.ndarray, dst_pages: np.ndarray,
                    notif: bytes) -> TransferHandle:
        notif = check_notif(notif)
        with self._lock:
            self._check_open()
            if self._pages is None:
                raise RuntimeError("register_pool before write_pages")
            p = self._peers.get(peer)
            if p is None:
                raise ValueError(f"unknown peer {peer!r} (known: {sorted(self._peers)})")
            src, dst = check_pages(src_pages, dst_pages, self._num_pages, p.num_pages, peer)
            if src.size > MAX_PAGES_PER_WRITE:
                raise ValueError(f"a ucxx write carries at most {MAX_PAGES_PER_WRITE} pages, got {src.size}")
            try:
                conn = self._connect(p)
            except Exception as e:  # noqa: BLE001 - reported through the handle, never raised
                return CompletedHandle(error=f"could not connect to {peer!r}: {_err(e)}")
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
            for i, s in enumerate(src.tolist()):
                reqs.append(conn.ep.tag_send(self._array(self._pages[s]), u.UCXXTag(page_tag(conn.conn_id, seq, i))))
        except Exception as e:  # noqa: BLE001 - a broken endpoint: fail this write, reconnect next time
            self._abort_conn(conn, f"could not post the write: {_err(e)}")
            return handle
        self._progress()
        return handle

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            if self._inbox is None:
                self._progress()
                return []
            return self._inbox.pump()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for p in list(self._peers.values()):
                self._drop_peer(p, "transport closed before the write completed")
            try:
                self._worker.cancel_inflight_requests()
                self._worker.progress()
            except Exception as e:  # noqa: BLE001
                log.debug("cancelling ucxx requests on close: %s", _err(e))
            self._closed = True
            self._inbox = None
            self._pages = self._buffer = None

