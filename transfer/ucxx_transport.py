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
  (UCX's peer error handling) excludes those transports and falls back to TCP, several times slower on one host
  (``pdserve bench transfer --backend ucxx --ucxx-error-handling both`` measures both).
* Host (DRAM) pools only; a CUDA pool raises ``ValueError`` (use NIXL there).
* No sends on an endpoint UCX reported failed (error handling on: the endpoint's ``alive``): a
  write progresses the worker once after its header and, if the peer is gone, fails and aborts
  the connection without posting its pages; the next write replaces a failed connection. UCX
  1.21 segfaults when a rendezvous page send fails at once on a dead peer in a context without a
  registration cache (``UCX_RCACHE_ENABLE=n``, or NIXL's UCX copy set up first in the process).

One UCX context and main worker per transport, no progress thread on it (on 2 cores ucxx's thread
competes with the scheduler): its progress happens inside ``write_pages``, ``TransferHandle.poll``,
``poll_notifs`` and ``close``, serialized by one lock.

Copy lanes (``copy_lanes=N``, target side; the decode worker's ``ucxx_copy_lanes``): N more UCX
workers (each in its own context), each owned by a thread that sleeps until a write's pages arrive for it
(``transfer/ucxx_lanes.py``); their addresses go in the metadata (``ucx_lanes``). An initiator
splits a write of at least ``LANE_MIN_BYTES`` over them (page ``i`` on lane ``i % N``), so N
rendezvous copies run in parallel and move while the target's worker loop computes; smaller writes
stay on the main worker: a prompt's few MB copy in well under a millisecond, and on 2 cores lanes
for them cost ~3% of PD throughput at 8 clients (bfloat16 prompts of 112-289 tokens, 2-7 MB), while
a 2,048-token migration (94 MB) copies 1.3x faster on 2 lanes.
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
from transfer.ucxx_inbox import Inbox
from transfer.ucxx_lanes import CopyLane, first_error
from transfer.ucxx_wire import HEADER_TAG, MAX_LANES, MAX_PAGES_PER_WRITE, WriteHeader, pack_header, page_lane, page_tag

log = logging.getLogger(__name__)

#: How long ``close_blocking`` may wait for UCX's endpoint teardown (ns).
_ABORT_PERIOD_NS = 100_000_000

#: A write of fewer bytes than this goes to the target's main worker even when it has copy lanes.
LANE_MIN_BYTES = 8 << 20


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
    """Endpoints to a peer: ``ep`` to its main worker (headers, small writes) and ``lane_eps`` to its
    copy lanes. Its tags carry ``conn_id``; a reconnect gets a new one."""

    ep: object
    conn_id: int
    lane_eps: list = field(default_factory=list)
    seq: int = 0
    handles: weakref.WeakSet[UcxxHandle] = field(default_factory=weakref.WeakSet)
    keep: list = field(default_factory=list)  # requests + buffers of writes aborted on this conn


@dataclass
class _Peer(PeerRecord):
    """A peer's UCX worker addresses (main, copy lanes) and, once written to, its connection."""

    address: bytes
    lane_addresses: list[bytes] = field(default_factory=list)
    conn: _Conn | None = None


class UcxxHandle(PendingHandle):
    """The header and page sends of one write. ``poll`` progresses the worker."""

    def __init__(self, transport: UcxxTransport, conn: _Conn, reqs: list, header: np.ndarray, deadline: float) -> None:
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
            t._abort_conn(
                self._conn,
                f"no completion within write_timeout_s={t.write_timeout_s:g}s "
                "(peer dead, or alive but not polling): connection aborted",
            )

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

    def __init__(
        self,
        name: str,
        *,
        error_handling: bool = False,
        write_timeout_s: float = 8.0,
        copy_lanes: int = 0,
        lane_min_bytes: int = LANE_MIN_BYTES,
    ) -> None:
        """``copy_lanes``: UCX workers with their own threads that receive the pages of large writes
        into this transport's pool (0..64; see the module docstring); created with the pool.
        ``lane_min_bytes``: as initiator, a write of at least this many bytes is split over the
        target's copy lanes (tests lower it)."""
        super().__init__(name)
        if not 0 <= int(copy_lanes) <= MAX_LANES:
            raise ValueError(f"copy_lanes must be 0..{MAX_LANES}, got {copy_lanes!r}")
        self.copy_lanes = int(copy_lanes)
        self.lane_min_bytes = max(1, int(lane_min_bytes))
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
    def _register(
        self, buffer: torch.Tensor, page_bytes: int, num_pages: int, length: int, mem_type: str, dev: int
    ) -> None:
        if mem_type != "DRAM":
            raise ValueError(
                "the ucxx backend moves host-memory pools only; use --transfer-backend nixl "
                f"for a pool on {buffer.device}"
            )
        pages = buffer.view(-1).view(torch.uint8).numpy().reshape(num_pages, page_bytes)
        lanes = [CopyLane(self._ucx, self._array, f"ucxx-lane-{k}") for k in range(self.copy_lanes)]
        self._inbox = Inbox(self._ucx, self._array, self._worker, pages, lanes)
        self._pages = pages

    def _metadata_extra(self) -> dict:
        b64 = lambda a: base64.b64encode(a).decode("ascii")  # noqa: E731
        lanes = [b64(lane.address) for lane in self._inbox.lanes] if self._inbox is not None else []
        return {
            "error_handling": self.error_handling,
            "ucx_address": b64(self._worker.address.tobytes()),
            "ucx_lanes": lanes,
        }

    def _parse_peer(self, name: str, md: dict) -> tuple[int, int, tuple[bytes, list[bytes]]]:
        page_bytes, num_pages = peer_pool_size(name, md)
        try:
            address = base64.b64decode(md["ucx_address"], validate=True)
            lanes = [base64.b64decode(a, validate=True) for a in md.get("ucx_lanes", [])]
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"peer {name!r} metadata: missing or bad ucx_address / ucx_lanes ({e})") from None
        if len(lanes) > MAX_LANES:
            raise ValueError(f"peer {name!r} metadata: {len(lanes)} copy lanes, at most {MAX_LANES}")
        return page_bytes, num_pages, (address, lanes)

    def _connect_peer(self, name: str, raw: bytes, md: dict, page_bytes: int, num_pages: int, blob) -> _Peer:
        address, lanes = blob
        return _Peer(name, raw, num_pages, page_bytes, address, lanes)  # connects on its first write

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """Forget the peer and abort its connection: its pending writes fail with ``why``."""
        self._peers.pop(peer.name, None)
        if peer.conn is not None:
            self._abort_conn(peer.conn, why)

    # ---- connections --------------------------------------------------------------------------
    def _connect(self, peer: _Peer) -> _Conn:
        """The peer's connection; a new one if it has none or UCX reported its endpoint failed."""
        if peer.conn is not None and not _alive(peer.conn):
            self._abort_conn(peer.conn, "UCX reported the connection failed (peer gone)")
        if peer.conn is None:
            conn_id = 0
            while conn_id == HEADER_TAG:
                conn_id = secrets.randbits(32)
            conn = _Conn(self._endpoint(peer.address), conn_id)
            peer.conn = conn  # set first: a failing lane endpoint aborts it with the others
            for a in peer.lane_addresses:
                conn.lane_eps.append(self._endpoint(a))
        return peer.conn

    def _endpoint(self, address: bytes):
        u = self._ucx
        addr = u.UCXAddress.create_from_buffer(np.frombuffer(address, dtype=np.uint8))
        return self._worker.create_endpoint_from_worker_address(addr, self.error_handling)

    def _abort_conn(self, conn: _Conn, why: str) -> None:
        """Fail every pending write on ``conn`` with ``why`` and abort its endpoint (idempotent)."""
        for h in list(conn.handles):
            h._fail(why)
        conn.handles.clear()
        for p in self._peers.values():
            if p.conn is conn:
                p.conn = None
        if conn.ep is not None:
            for ep in (conn.ep, *conn.lane_eps):
                try:
                    ep.close_blocking(period=_ABORT_PERIOD_NS, max_attempts=1)
                except Exception as e:  # noqa: BLE001 - the endpoint is already broken
                    log.debug("aborting a ucxx endpoint: %s", err_text(e))
            self._dead.append(conn)  # its requests may still reference their buffers
            conn.ep, conn.lane_eps = None, []

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
            if peer.conn is not None:
                self._abort_conn(peer.conn, f"could not connect: {err_text(e)}")
            return CompletedHandle(error=f"could not connect to {peer.name!r}: {err_text(e)}")
        return self._post(conn, src, dst, notif)

    def _post(self, conn: _Conn, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        u, seq = self._ucx, conn.seq
        conn.seq = (conn.seq + 1) & 0xFFFF
        deadline = time.monotonic() + self.write_timeout_s
        lanes = len(conn.lane_eps) if src.size * self._pages.shape[1] >= self.lane_min_bytes else 0
        header = pack_header(
            WriteHeader(self.name, conn.conn_id, seq, dst, notif, time.time() + self.write_timeout_s, lanes)
        )
        reqs: list = []
        handle = UcxxHandle(self, conn, reqs, header, deadline)
        conn.handles.add(handle)
        try:
            reqs.append(conn.ep.tag_send(self._array(header), u.UCXXTag(HEADER_TAG)))
            self._progress()  # lets UCX report a peer the header found dead (error handling on)
            if not _alive(conn):  # no page sends on a failed endpoint (see the module docstring)
                self._abort_conn(conn, "UCX reported the connection failed (peer gone)")
                return handle
            for i, s in enumerate(src.tolist()):
                k = page_lane(i, lanes)
                ep = conn.lane_eps[k] if k >= 0 else conn.ep
                reqs.append(ep.tag_send(self._array(self._pages[s]), u.UCXXTag(page_tag(conn.conn_id, seq, i))))
        except Exception as e:  # noqa: BLE001 - a broken endpoint: fail this write, reconnect next time
            self._abort_conn(conn, f"could not post the write: {err_text(e)}")
            return handle
        self._progress()
        return handle

    @property
    def lane_writes(self) -> int:
        """Writes received so far whose pages came over the copy lanes."""
        return self._inbox.lane_writes if self._inbox is not None else 0

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
        if self._inbox is not None:
            self._inbox.close()
        self._inbox = None
        self._pages = None


def _alive(conn: _Conn) -> bool:
    """Whether UCX still reports every endpoint of ``conn`` usable."""
    return conn.ep is not None and conn.ep.alive and all(ep.alive for ep in conn.lane_eps)
