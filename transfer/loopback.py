"""In-process ``KVTransport`` for tests and single-process setups.

Transports register themselves by name in a process-wide registry; ``add_peer`` looks the peer up
there (the metadata carries its name and an instance id, so a re-created peer of the same name is
noticed). A write is a tensor copy of whole pages (``torch`` index copy on the pools' byte views,
across devices if needed); the notification is queued to the target after the copy, so a handle
is always terminal when ``write_pages`` returns.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from transfer.kv_transport import CompletedHandle, TransferHandle, decode_metadata
from transfer.transport_base import PeerRecord, TransportBase

_registry: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_instance_ids = itertools.count(1)


@dataclass
class _Peer(PeerRecord):
    """A peer in this process: the live transport its metadata named."""

    target: LoopbackTransport


class LoopbackTransport(TransportBase):
    """In-process ``KVTransport``: peers are live objects of this process, writes are tensor copies.

    The shared checks come from ``TransportBase``. What differs: ``add_peer`` resolves the peer in
    the process registry every time (no connection to keep, so no own-name or restart handling),
    and notifications are queued under a separate ``_notif_lock``, taken by the writer after the
    copy (a writer holds its own ``_lock``, never the target's)."""

    backend = "loopback"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._notif_lock = threading.Lock()
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._pages: torch.Tensor | None = None  # uint8 view [num_pages, page_bytes]
        self._instance_id = next(_instance_ids)
        with _registry_lock:
            other = _registry.get(name)
            if other is not None and not other._closed:
                raise ValueError(f"a loopback transport named {name!r} already exists in this process")
            _registry[name] = self

    # ---- setup --------------------------------------------------------------------------------
    def _register(
        self, buffer: torch.Tensor, page_bytes: int, num_pages: int, length: int, mem_type: str, dev: int
    ) -> None:
        self._pages = buffer.view(-1).view(torch.uint8).view(num_pages, page_bytes)

    def _metadata_extra(self) -> dict:
        return {"instance": self._instance_id}

    def add_peer(self, peer_metadata: bytes) -> str:
        """Look the peer up in this process by name and instance id; ``ValueError`` if it is not
        a live loopback transport. Adding it again re-resolves it."""
        md = decode_metadata(peer_metadata, self.backend)
        with self._lock:
            self._check_open()
            self._check_page_bytes(md["name"], md["page_bytes"])
            with _registry_lock:
                target = _registry.get(md["name"])
            if target is None or target._closed or target._instance_id != md.get("instance"):
                raise ValueError(
                    f"no live loopback transport {md['name']!r} (instance {md.get('instance')}) in this process"
                )
            self._peers[md["name"]] = _Peer(
                md["name"], bytes(peer_metadata), target._num_pages, target._page_bytes, target
            )
            return md["name"]

    # ---- data path ----------------------------------------------------------------------------
    def _write(self, peer: _Peer, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        target = peer.target
        if target._closed or target._pages is None:
            return CompletedHandle(error=f"peer {peer.name!r} is closed")
        if target._page_bytes != self._page_bytes:
            raise ValueError(f"peer {peer.name!r} page_bytes {target._page_bytes} != {self._page_bytes}")
        if src.size:
            dst_pool = target._pages
            src_idx = torch.from_numpy(src.astype(np.int64)).to(self._pages.device)
            dst_idx = torch.from_numpy(dst.astype(np.int64)).to(dst_pool.device)
            data = self._pages.index_select(0, src_idx).to(dst_pool.device)
            dst_pool.index_copy_(0, dst_idx, data)
            if dst_pool.device.type == "cuda":
                torch.cuda.synchronize(dst_pool.device)
        if not target._deliver(self.name, notif):
            return CompletedHandle(error=f"peer {peer.name!r} closed during the write")
        return CompletedHandle()

    def _deliver(self, sender: str, notif: bytes) -> bool:
        with self._notif_lock:
            if self._closed:
                return False
            self._notifs.append((sender, notif))
            return True

    def _take_notifs(self) -> list[tuple[str, bytes]]:
        out = list(self._notifs)
        self._notifs.clear()
        return out

    def _teardown(self) -> None:
        self._notifs.clear()
        self._peers.clear()
        self._pages = None

    def close(self) -> None:
        """``TransportBase.close``, then the name is free for a new loopback transport."""
        super().close()
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]
