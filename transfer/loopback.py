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

import numpy as np
import torch

from transfer.kv_transport import (
    CompletedHandle,
    KVTransport,
    TransferHandle,
    check_notif,
    check_pages,
    decode_metadata,
    device_of,
    encode_metadata,
    pool_geometry,
)

_registry: "weakref.WeakValueDictionary[str, LoopbackTransport]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()
_instance_ids = itertools.count(1)


class LoopbackTransport(KVTransport):
    backend = "loopback"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._lock = threading.RLock()
        self._notif_lock = threading.Lock()
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._pages: torch.Tensor | None = None  # uint8 view [num_pages, page_bytes]
        self._buffer: torch.Tensor | None = None
        self._page_bytes = 0
        self._num_pages = 0
        self._peers: dict[str, tuple[int, LoopbackTransport]] = {}  # name -> (instance id, transport)
        self._closed = False
        self._instance_id = next(_instance_ids)
        with _registry_lock:
            other = _registry.get(name)
            if other is not None and not other._closed:
                raise ValueError(f"a loopback transport named {name!r} already exists in this process")
            _registry[name] = self

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
            device_of(buffer)  # validates the device type
            self._buffer = buffer
            self._pages = buffer.view(-1).view(torch.uint8).view(num_pages, page_bytes)
            self._page_bytes = int(page_bytes)
            self._num_pages = num_pages

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._buffer is None:
                raise RuntimeError("register_pool before local_metadata")
            mem_type, dev = device_of(self._buffer)
            return encode_metadata({
                "backend": self.backend, "name": self.name, "instance": self._instance_id,
                "mem_type": mem_type, "device": dev, "base": self._buffer.data_ptr(),
                "length": self._num_pages * self._page_bytes,
                "page_bytes": self._page_bytes, "num_pages": self._num_pages,
            })

    def add_peer(self, peer_metadata: bytes) -> str:
        md = decode_metadata(peer_metadata, self.backend)
        with self._lock:
            self._check_open()
            if self._buffer is not None and int(md["page_bytes"]) != self._page_bytes:
                raise ValueError(f"peer {md['name']!r} has page_bytes={md['page_bytes']}, "
                                 f"local pool has {self._page_bytes}")
            with _registry_lock:
                target = _registry.get(md["name"])
            if target is None or target._closed or target._instance_id != md.get("instance"):
                raise ValueError(f"no live loopback transport {md['name']!r} (instance "
                                 f"{md.get('instance')}) in this process")
            self._peers[md["name"]] = (target._instance_id, target)
            return md["name"]

    def remove_peer(self, name: str) -> None:
        with self._lock:
            self._peers.pop(name, None)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ---- data path ----------------------------------------------------------------------------
    def write_pages(self, peer: str, src_pages: np.ndarray, dst_pages: np.ndarray,
                    notif: bytes) -> TransferHandle:
        notif = check_notif(notif)
        with self._lock:
            self._check_open()
            if self._pages is None:
                raise RuntimeError("register_pool before write_pages")
            entry = self._peers.get(peer)
            if entry is None:
                raise ValueError(f"unknown peer {peer!r} (known: {sorted(self._peers)})")
            _, target = entry
            src, dst = check_pages(src_pages, dst_pages, self._num_pages, target._num_pages, peer)
            if target._closed or target._pages is None:
                return CompletedHandle(error=f"peer {peer!r} is closed")
            if target._page_bytes != self._page_bytes:
                raise ValueError(f"peer {peer!r} page_bytes {target._page_bytes} != {self._page_bytes}")
            if src.size:
                dst_pool = target._pages
                src_idx = torch.from_numpy(src.astype(np.int64)).to(self._pages.device)
                dst_idx = torch.from_numpy(dst.astype(np.int64)).to(dst_pool.device)
                data = self._pages.index_select(0, src_idx).to(dst_pool.device)
                dst_pool.index_copy_(0, dst_idx, data)
                if dst_pool.device.type == "cuda":
                    torch.cuda.synchronize(dst_pool.device)
            if not target._deliver(self.name, notif):
                return CompletedHandle(error=f"peer {peer!r} closed during the write")
            return CompletedHandle()

    def _deliver(self, sender: str, notif: bytes) -> bool:
        with self._notif_lock:
            if self._closed:
                return False
            self._notifs.append((sender, notif))
            return True

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        with self._notif_lock:
            self._check_open()
            out = list(self._notifs)
            self._notifs.clear()
            return out

    def close(self) -> None:
        with self._lock, self._notif_lock:
            if self._closed:
                return
            self._closed = True
            self._notifs.clear()
            self._peers.clear()
            self._pages = None
            self._buffer = None
        with _registry_lock:
            if _registry.get(self.name) is self:
                del _registry[self.name]
