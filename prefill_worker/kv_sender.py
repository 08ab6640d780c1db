"""Prefill side of the KV data plane: decode peers (after a handshake) and in-flight writes."""

from __future__ import annotations

import base64
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from cache.kv_pools import FULL, SWA, PoolGeometry
from prefill_worker.kv_writer import KVWriter
from transfer.kv_transport import WARMUP_NOTIF, KVTransport, TransferHandle
from transfer.wire.outbox import Conn
from transfer.wire.protocol import KVHandshake, TransferManifest

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    conn: Conn  # the decode worker's connection to our control socket
    transport_name: str
    geometry: PoolGeometry  # where its pools sit in its unit rows


@dataclass
class _InFlight:
    job: object
    future: Future  # -> (TransferHandle, monotonic end or None): ``KVWriter.submit``
    started: float  # time.monotonic()
    nbytes: int


@dataclass(frozen=True)
class WriteEnded:
    """A write that ended: ``ok`` or ``error``; ``seconds`` from ``start`` to its end, which is
    ``ended_at`` (monotonic): when the writing thread saw it end, or else when ``poll`` did."""

    job: object
    ok: bool
    error: str | None
    nbytes: int
    seconds: float
    ended_at: float


class KVSender:
    """Owns the KV transport on the prefill side: decode peers that completed the handshake and
    the writes in flight. Sends no control messages itself."""

    def __init__(self, transport: KVTransport, unit_bytes: int, threaded: bool = True) -> None:
        """``unit_bytes``: size of one transport row (``KVPools.unit_bytes``). ``threaded=False``
        runs writes inline (deterministic unit tests with the loopback transport, whose writes
        complete inside ``write_pages``)."""
        self.transport = transport
        self.page_bytes = unit_bytes
        self.peers: dict[str, _Peer] = {}
        self.inflight: list[_InFlight] = []
        self._warmups: list[Future] = []  # of ``WARMUP_NOTIF`` writes, released once they ended
        self.writer = KVWriter(transport) if threaded else None

    def accept_peer(
        self, conn: Conn, hs: KVHandshake, model: str, layout: dict, cluster_id: str = "", worker_id: str = ""
    ) -> str | None:
        """Validate a decode worker's handshake (same cluster, model, KV layout, transport);
        register its pool and set the connection up (``_warm``). Returns an error or None."""
        if hs.cluster_id != cluster_id:
            return (
                f"cluster mismatch: decode worker {hs.worker_id} belongs to cluster {hs.cluster_id!r}, this "
                f"prefill worker {worker_id} to {cluster_id!r}: the decode worker reached another deployment's "
                f"worker (check --base-port / --cluster-id)"
            )
        if hs.model != model:
            return f"model mismatch: decode worker serves {hs.model!r}, prefill worker serves {model!r}"
        for key in sorted(set(layout) | set(hs.layout)):
            if layout.get(key) != hs.layout.get(key):
                return (
                    f"KV layout mismatch on {key}: decode has {hs.layout.get(key)!r}, prefill has {layout.get(key)!r}"
                )
        if hs.transport != self.transport.backend:
            return f"transport mismatch: decode uses {hs.transport}, prefill uses {self.transport.backend}"
        try:
            name = self.transport.add_peer(base64.b64decode(hs.transport_metadata))
        except Exception as e:  # noqa: BLE001 - report any transport failure to the peer
            return f"could not connect to the decode worker's KV pool: {e}"
        self.peers[hs.worker_id] = _Peer(conn, name, PoolGeometry(*hs.pool_geometry))
        log.info("decode worker %s connected (transport peer %s)", hs.worker_id, name)
        self._warm(name)
        return None

    def _warm(self, name: str) -> None:
        """Write no pages to a new peer, with ``WARMUP_NOTIF``: the connection is set up now, while
        the peer only handshakes, not in its first transfer (on NIXL that setup waits for the
        target's next poll, up to one of its steps). A failure here is left to that transfer."""
        empty = np.zeros(0, dtype=np.int32)
        self._warmups.append(self._submit(name, empty, empty, WARMUP_NOTIF))

    def dest_rows(self, decode_worker: str, full_pages, swa_pages) -> np.ndarray:
        """The decode worker's unit rows of its ``full_pages`` then ``swa_pages``."""
        g = self.peers[decode_worker].geometry
        rows = [g.units(FULL, full_pages)] + ([g.units(SWA, swa_pages)] if len(swa_pages) else [])
        return np.concatenate(rows)

    def conn_of(self, decode_worker: str) -> Conn | None:
        """The control connection of a decode worker that completed the handshake."""
        peer = self.peers.get(decode_worker)
        return peer.conn if peer is not None else None

    @property
    def busy(self) -> bool:
        return bool(self.inflight)

    def start(self, job, decode_worker: str, src: np.ndarray, dst: np.ndarray, manifest: TransferManifest) -> None:
        peer = self.peers.get(decode_worker)
        if peer is None:
            raise RuntimeError(f"decode worker {decode_worker!r} has not completed the KV handshake")
        future = self._submit(peer.transport_name, src, dst, manifest.model_dump_json().encode())
        self.inflight.append(_InFlight(job, future, time.monotonic(), len(src) * self.page_bytes))

    def _submit(self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes) -> Future:
        """Post a write on the writing thread (``KVWriter``), or inline, completed through the same
        future of ``(handle, ended_at)``."""
        if self.writer is not None:
            return self.writer.submit(peer, src, dst, notif)
        future: Future = Future()
        try:
            future.set_result((self.transport.write_pages(peer, src, dst, notif), None))
        except Exception as e:  # noqa: BLE001 - reported through the future like the threaded path
            future.set_exception(e)
        return future

    def poll(self) -> list[WriteEnded]:
        """Every write that ended since the last call (warm-up writes are settled, not reported)."""
        self._warmups = [f for f in self._warmups if not self._settled(f)]
        ended, still = [], []
        for f in self.inflight:
            state, error, end = self._state(f)
            if state == "pending":
                still.append(f)
                continue
            end = end or time.monotonic()
            ended.append(WriteEnded(f.job, state == "done", error, f.nbytes, end - f.started, end))
        self.inflight = still
        return ended

    @staticmethod
    def _settled(f: Future) -> bool:
        """Whether a warm-up write ended (a failure is left to the peer's first transfer)."""
        return f.done() and (f.exception() is not None or _poll_release(f.result()[0]) != "pending")

    @staticmethod
    def _state(f: _InFlight) -> tuple[str, str | None, float | None]:
        """(state, error, when the writing thread saw it end or None)."""
        if not f.future.done():
            return "pending", None, None
        if f.future.exception() is not None:
            return "error", f"could not start the KV write: {f.future.exception()}", None
        handle, ended_at = f.future.result()
        state = _poll_release(handle)
        return state, getattr(handle, "error", None) or (None if state != "error" else "transport error"), ended_at

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _poll_release(handle: TransferHandle) -> str:
    """The handle's state; released once it is terminal."""
    state = handle.poll()
    if state != "pending":
        handle.release()
    return state
