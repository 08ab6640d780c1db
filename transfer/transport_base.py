"""What the KV transport backends share: argument checks and state checks as template methods.

``KVTransport`` (``transfer/kv_transport.py``) states the contract; the classes here implement the
part of it every backend does the same way, so each backend keeps only its data plane:

* ``TransportBase`` owns the lock, the closed flag, the registered pool's geometry and the peer
  table. Its public methods check their arguments and the transport's state (closed, pool
  registered or not, unknown peer, page ids, notif) and then call one hook under the lock:
  ``_register`` (the pool), ``_metadata_extra`` (the backend's connection blob), ``_write`` (the
  copy and its notification), ``_take_notifs`` (received notifications), ``_drop_peer`` and
  ``_teardown`` (``close``). ``add_peer`` stays abstract: the in-process loopback resolves peers in
  its registry, the remote backends use ``RemoteTransportBase``.
* ``RemoteTransportBase`` adds ``add_peer`` for backends that connect to another process from its
  metadata blob (NIXL, ucxx): the shared peer checks (own name, empty pool, ``page_bytes``
  mismatch), idempotence on identical metadata and replacement of a restarted peer; the backend
  parses its blob in ``_parse_peer`` and connects in ``_connect_peer``.
* ``PendingHandle`` is a handle whose write may still be in flight: ``poll`` and ``release`` take
  the transport's lock, fail the write once the transport is closed or the handle released, and
  call the backend's ``_advance``/``_release_resources``.

Every hook but ``_parse_peer`` runs with the transport's lock held (``self._lock``, reentrant;
``_take_notifs``: ``self._notif_lock``); the template has already checked what its docstring says.
Error messages are the ones the backends raised before these classes existed.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from transfer.kv_transport import (
    KVTransport,
    TransferHandle,
    TransferState,
    check_notif,
    check_pages,
    decode_metadata,
    device_of,
    encode_metadata,
    pool_geometry,
)

if TYPE_CHECKING:
    from transfer.notif_seal import NotifSeal


def err_text(e: BaseException) -> str:
    """``"ExceptionType: message"``: how a backend failure reads in ``handle.error`` and logs."""
    return f"{type(e).__name__}: {e}"


@dataclass
class PeerRecord:
    """A known peer: its name, the metadata it was added with (``raw``, compared for idempotence)
    and its pool's geometry. Backends subclass it to add their connection state."""

    name: str
    raw: bytes
    num_pages: int
    page_bytes: int


def peer_pool_size(name: str, md: dict) -> tuple[int, int]:
    """``(page_bytes, num_pages)`` of a peer's metadata; ``ValueError`` for an empty pool."""
    page_bytes, num_pages = int(md["page_bytes"]), int(md["num_pages"])
    if page_bytes <= 0 or num_pages <= 0:
        raise ValueError(f"peer {name!r} has an empty pool ({num_pages} pages of {page_bytes} bytes)")
    return page_bytes, num_pages


class PendingHandle(TransferHandle):
    """A write that may still be in flight on ``transport`` (a ``TransportBase``).

    ``poll`` returns a terminal state without locking; otherwise, under the transport's lock, it
    fails the write if the transport is closed and else calls ``_advance``. ``_fail`` makes the
    first failure stick. ``release`` fails a pending write ("released before completion") and then
    calls ``_release_resources``; both must be idempotent."""

    def __init__(self, transport: TransportBase) -> None:
        self._transport = transport
        self._state: TransferState = "pending"
        self.error = None

    def poll(self) -> TransferState:
        if self._state != "pending":
            return self._state
        t = self._transport
        with t._lock:
            if self._state == "pending":
                if t._closed:
                    self._fail("transport closed before the write completed")
                else:
                    self._advance()
        return self._state

    @abc.abstractmethod
    def _advance(self) -> None:
        """Progress the write (lock held, state pending, transport open): set ``self._state`` to
        ``"done"`` or call ``_fail`` once the backend knows, leave it pending otherwise."""

    def _fail(self, why: str) -> None:
        """Turn a pending write into ``"error"`` with reason ``why``; no-op once terminal."""
        if self._state == "pending":
            self._state, self.error = "error", why
            self._on_fail()

    def _on_fail(self) -> None:
        """Called once, when the write fails (lock held). Default: nothing."""

    def release(self) -> None:
        """Fail a pending write, then ``_release_resources``; idempotent."""
        with self._transport._lock:
            if self._state == "pending":
                self._fail("released before completion")
            self._release_resources()

    @abc.abstractmethod
    def _release_resources(self) -> None:
        """Free what the backend holds for this write (lock held, state terminal). Idempotent."""


class TransportBase(KVTransport):
    """Checks and state shared by every backend; subclasses implement the hooks below.

    State kept here, read by the hooks: ``_lock`` (reentrant; every public method and most
    hooks run under it), ``_notif_lock`` (taken by ``poll_notifs`` and ``close``; the same lock
    unless a backend needs a separate one), ``_closed``, ``_peers`` (name -> ``PeerRecord``;
    backends change it only in ``add_peer``, ``_drop_peer`` and ``_teardown``), and the
    registered pool: ``_buffer``, ``_page_bytes``, ``_num_pages``, ``_mem_type``, ``_dev``,
    ``_base`` (``_buffer`` is ``None`` before ``register_pool`` and after ``close``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lock = threading.RLock()
        self._notif_lock = self._lock
        self._closed = False
        self._peers: dict[str, PeerRecord] = {}
        self._buffer: torch.Tensor | None = None
        self._page_bytes = self._num_pages = 0
        self._mem_type, self._dev, self._base = "", 0, 0
        self._seal: NotifSeal | None = None

    # ---- checks -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        """``RuntimeError`` once the transport is closed."""
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")

    def _check_registered(self, before: str) -> None:
        """``RuntimeError`` unless a pool is registered (``before``: the method that needs it)."""
        if self._buffer is None:
            raise RuntimeError(f"register_pool before {before}")

    def _check_page_bytes(self, peer: str, page_bytes) -> None:
        """``ValueError`` if a registered local pool's page size differs from the peer's."""
        if self._buffer is not None and int(page_bytes) != self._page_bytes:
            raise ValueError(f"peer {peer!r} has page_bytes={page_bytes}, local pool has {self._page_bytes}")

    # ---- templates ----------------------------------------------------------------------------
    def register_pool(self, buffer: torch.Tensor, page_bytes: int) -> None:
        """Validate the pool (``pool_geometry``, ``device_of``), once per transport, then
        ``_register`` it; the pool's state is recorded only if ``_register`` returns."""
        with self._lock:
            self._check_open()
            if self._buffer is not None:
                raise RuntimeError(f"transport {self.name!r} already has a registered pool")
            num_pages, length = pool_geometry(buffer, page_bytes)
            mem_type, dev = device_of(buffer)
            self._register(buffer, int(page_bytes), num_pages, length, mem_type, dev)
            self._buffer, self._page_bytes, self._num_pages = buffer, int(page_bytes), num_pages
            self._mem_type, self._dev, self._base = mem_type, dev, buffer.data_ptr()

    @abc.abstractmethod
    def _register(
        self, buffer: torch.Tensor, page_bytes: int, num_pages: int, length: int, mem_type: str, dev: int
    ) -> None:
        """Make the validated pool (``length`` bytes of ``mem_type`` ``"DRAM"``/``"VRAM"`` on device
        ``dev``) usable by the data plane, or raise (``ValueError`` for a pool this backend cannot
        move) leaving nothing held."""

    def local_metadata(self) -> bytes:
        """The common metadata fields plus ``_metadata_extra()``, JSON-encoded."""
        with self._lock:
            self._check_open()
            self._check_registered("local_metadata")
            return encode_metadata(
                {
                    "backend": self.backend,
                    "name": self.name,
                    "mem_type": self._mem_type,
                    "device": self._dev,
                    "base": self._base,
                    "length": self._num_pages * self._page_bytes,
                    "page_bytes": self._page_bytes,
                    "num_pages": self._num_pages,
                    **self._metadata_extra(),
                }
            )

    def _metadata_extra(self) -> dict:
        """Backend fields of ``local_metadata`` (pool registered). Default: none."""
        return {}

    def remove_peer(self, name: str) -> None:
        """Drop a known peer of an open transport with ``_drop_peer``; otherwise nothing."""
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and not self._closed:
                self._drop_peer(peer, f"peer {name!r} removed")

    def _drop_peer(self, peer: PeerRecord, why: str) -> None:
        """Forget ``peer`` and whatever connects to it; its pending writes fail with ``why`` where
        the backend tracks them. Must not raise. Default: remove it from the table."""
        self._peers.pop(peer.name, None)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def use_seal(self, seal: NotifSeal | None) -> None:
        """Seal every notification this transport sends with ``seal`` and deliver only received ones
        whose seal verifies (``transfer.notif_seal``); None (the default): plain notifications."""
        with self._lock, self._notif_lock:
            self._seal = seal

    def write_pages(self, peer: str, src_pages: np.ndarray, dst_pages: np.ndarray, notif: bytes) -> TransferHandle:
        """Check the notif, the transport's state, the peer and both page lists (``check_pages``
        against both pools), then ``_write`` (the notif sealed when ``use_seal`` gave a seal)."""
        notif = check_notif(notif)
        if self._seal is not None:
            notif = self._seal.seal(self.name, notif)
        with self._lock:
            self._check_open()
            self._check_registered("write_pages")
            p = self._peers.get(peer)
            if p is None:
                raise ValueError(f"unknown peer {peer!r} (known: {sorted(self._peers)})")
            src, dst = check_pages(src_pages, dst_pages, self._num_pages, p.num_pages, peer)
            return self._write(p, src, dst, notif)

    @abc.abstractmethod
    def _write(self, peer: PeerRecord, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        """Start the write of checked int32 page ids (possibly empty: notif only). Transport
        failures go into the returned handle, never raised; ``ValueError`` only for a limit of the
        backend's own."""

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Check the transport is open, then ``_take_notifs`` (under ``_notif_lock``); with a seal,
        only the notifications whose seal verifies, unsealed (the others are dropped and logged)."""
        with self._notif_lock:
            self._check_open()
            got = self._take_notifs()
            if self._seal is None:
                return got
            opened = [(sender, self._seal.open(sender, notif)) for sender, notif in got]
            return [(sender, notif) for sender, notif in opened if notif is not None]

    @abc.abstractmethod
    def _take_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call (``_notif_lock`` held, transport open)."""

    def close(self) -> None:
        """``_teardown`` once, then mark the transport closed and forget the pool."""
        with self._lock, self._notif_lock:
            if self._closed:
                return
            self._teardown()
            self._closed = True
            self._buffer = None

    @abc.abstractmethod
    def _teardown(self) -> None:
        """Release every backend resource (peers, pending writes, registrations); log, do not
        raise, what fails. Both locks held; the transport is still marked open."""


class RemoteTransportBase(TransportBase):
    """``add_peer`` for backends whose peers are other processes, known by a metadata blob."""

    def add_peer(self, peer_metadata: bytes) -> str:
        """Decode and check the metadata (``_parse_peer``); under the lock refuse our own metadata
        and a ``page_bytes`` mismatch, return at once for the metadata already known, replace a
        peer known under the same name (it restarted) and ``_connect_peer``."""
        raw = bytes(peer_metadata)
        md = decode_metadata(raw, self.backend)
        name = str(md["name"])
        page_bytes, num_pages, blob = self._parse_peer(name, md)
        with self._lock:
            self._check_open()
            if name == self.name:
                raise ValueError(f"peer metadata is this transport's own ({name!r})")
            self._check_page_bytes(name, page_bytes)
            old = self._peers.get(name)
            if old is not None:
                if old.raw == raw:
                    return name
                self._drop_peer(old, f"peer {name!r} restarted")  # new memory, new connection
            self._peers[name] = self._connect_peer(name, raw, md, page_bytes, num_pages, blob)
            return name

    @abc.abstractmethod
    def _parse_peer(self, name: str, md: dict) -> tuple[int, int, bytes]:
        """``(page_bytes, num_pages, connection blob)`` from decoded metadata (no lock held):
        check the backend's fields and ``peer_pool_size``, ``ValueError`` naming the problem."""

    @abc.abstractmethod
    def _connect_peer(
        self, name: str, raw: bytes, md: dict, page_bytes: int, num_pages: int, blob: bytes
    ) -> PeerRecord:
        """The record of a new peer (lock held, name not in the table), connected as far as the
        backend connects eagerly; raise leaving nothing held if that fails."""
