"""``KVTransport`` over NIXL (UCX backend): one-sided RDMA-style WRITE of KV pages + notification.

How it maps onto NIXL (nixl 1.5 python API):

* One agent per transport, created **without** a progress thread and without the listener thread
  (``nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)``), so NIXL's thread
  sync mode is NONE and every agent call is serialized by this class's lock. UCX progress happens
  only inside our calls: ``write_pages`` (post), ``TransferHandle.poll`` (status) and
  ``poll_notifs`` (notifications).
* UCX backend with ``ucx_error_handling_mode=peer``: a dead peer turns into
  ``nixlRemoteDisconnectError`` at the next post/status call (well under a second on loopback),
  which the handle reports as ``"error"``.
* ``register_pool`` registers the whole pool as one region and prepares the local descriptor list
  once (``prep_xfer_dlist("NIXL_INIT_AGENT", ...)``): one descriptor per page, either an Nx3
  ``(addr, len, dev)`` array (``dlist_form="list"``, default) or the single-row Nx5 strided form
  ``(base, page_bytes, dev, page_bytes, num_pages)`` (``dlist_form="strided"``); both index pages
  the same way. ``add_peer`` prepares the peer's list once the same way from its metadata.
* ``write_pages`` = ``make_prepped_xfer("WRITE", local, src, remote, dst, notif)`` +
  ``transfer``. NIXL merges runs of pages adjacent on both sides into one descriptor. On host
  memory UCX copies with CMA inside ``transfer`` (GIL released), so the call blocks for the copy;
  on CUDA memory (``cuda_ipc``/RDMA) it returns while the copy runs and ``poll`` tracks it.
  The notification (UCX active message, TCP on a single host) is sent after the data and is only
  completed when the target progresses its worker, i.e. calls ``poll_notifs``.

Metadata (``local_metadata``) is JSON: name, memory type, device, base, length, page size, page
count and NIXL's own agent metadata blob as base64. No pickle anywhere.
"""
from __future__ import annotations

import base64
import importlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transfer.kv_transport import (
    CompletedHandle,
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

log = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api", "nixl")


def _nixl():
    """The NIXL python API module (``nixl_cu12`` wheel here; ``nixl`` meta package elsewhere)."""
    errors = []
    for name in _NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken native library
            errors.append(f"{name}: {e}")
            continue
        if hasattr(mod, "nixl_agent") and hasattr(mod, "nixl_agent_config"):
            return mod
        errors.append(f"{name}: no nixl_agent")
    raise RuntimeError("NIXL python API not importable (" + "; ".join(errors) + ")")


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _page_descs(base: int, page_bytes: int, num_pages: int, dev: int, form: str) -> np.ndarray:
    if form == "strided":
        return np.array([[base, page_bytes, dev, page_bytes, num_pages]], dtype=np.uint64)
    descs = np.empty((num_pages, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base) + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_bytes)
    descs[:, 1] = page_bytes
    descs[:, 2] = dev
    return descs


@dataclass
class _Peer:
    name: str
    raw: bytes
    num_pages: int
    page_bytes: int
    mem_type: str
    dlist: Any  # nixl_prepped_dlist_handle


class NixlHandle(TransferHandle):
    """A posted NIXL WRITE. ``poll`` progresses the agent's UCX worker."""

    def __init__(self, transport: "NixlTransport", xfer, state: TransferState, error: str | None) -> None:
        self._transport = transport
        self._xfer = xfer
        self._state: TransferState = state
        self.error = error

    def poll(self) -> TransferState:
        if self._state != "pending":
            return self._state
        t = self._transport
        with t._lock:
            if self._state != "pending":
                return self._state
            if t._closed or self._xfer is None:
                self._fail("transport closed before the write completed")
                return self._state
            try:
                status = t._agent.check_xfer_state(self._xfer)
            except Exception as e:  # nixlRemoteDisconnectError and friends
                self._fail(_err(e))
                return self._state
            if status == "DONE":
                self._state = "done"
            elif status == "ERR":
                self._fail("NIXL reported the transfer failed")
        return self._state

    def _fail(self, why: str) -> None:
        self._state = "error"
        self.error = why
        self._transport._saw_error = True

    def release(self) -> None:
        t = self._transport
        with t._lock:
            xfer, self._xfer = self._xfer, None
            if xfer is None:
                return
            if self._state == "pending":
                self._fail("released before completion")
            t._handles.discard(self)
            try:
                xfer.release()  # NIXL cancels a pending transfer; may refuse (then it is leaked to the agent)
            except Exception as e:
                log.warning("releasing NIXL transfer handle failed: %s", _err(e))


class NixlTransport(KVTransport):
    """NIXL/UCX implementation of ``KVTransport`` (DRAM or VRAM pools)."""

    backend = "nixl"

    def __init__(self, name: str, *, dlist_form: str = "list", num_workers: int = 1,
                 capture_telemetry: bool = False) -> None:
        super().__init__(name)
        if dlist_form not in ("list", "strided"):
            raise ValueError(f"dlist_form must be 'list' or 'strided', got {dlist_form!r}")
        nixl = _nixl()
        self._dlist_form = dlist_form
        self._lock = threading.RLock()
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._handles: "weakref.WeakSet[NixlHandle]" = weakref.WeakSet()
        self._saw_error = False
        self._buffer: torch.Tensor | None = None
        self._reg = None
        self._local_dlist = None
        self._mem_type = ""
        self._dev = 0
        self._base = 0
        self._page_bytes = 0
        self._num_pages = 0
        config = nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                        backends=[], capture_telemetry=capture_telemetry)
        self._agent = nixl.nixl_agent(name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise RuntimeError(f"NIXL has no UCX plugin (plugins: {self._agent.get_plugin_list()})")
        self._agent.create_backend("UCX", {"ucx_error_handling_mode": "peer",
                                           "num_workers": str(int(num_workers))})

    # ---- setup --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"transport {self.name!r} is closed")

    @property
    def agent(self):
        """The underlying ``nixl_agent`` (for telemetry/diagnostics; hold no long references)."""
        return self._agent

    def register_pool(self, buffer: torch.Tensor, page_bytes: int) -> None:
        with self._lock:
            self._check_open()
            if self._buffer is not None:
                raise RuntimeError(f"transport {self.name!r} already has a registered pool")
            num_pages, length = pool_geometry(buffer, page_bytes)
            mem_type, dev = device_of(buffer)
            base = buffer.data_ptr()
            reg = self._agent.register_memory([(base, length, dev, "")], mem_type)
            try:
                local = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _page_descs(base, int(page_bytes), num_pages, dev, self._dlist_form),
                    mem_type)
            except Exception:
                self._agent.deregister_memory(reg)
                raise
            self._buffer, self._reg, self._local_dlist = buffer, reg, local
            self._mem_type, self._dev, self._base = mem_type, dev, base
            self._page_bytes, self._num_pages = int(page_bytes), num_pages

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            if self._buffer is None:
                raise RuntimeError("register_pool before local_metadata")
            blob = self._agent.get_agent_metadata()
            return encode_metadata({
                "backend": self.backend, "name": self.name, "mem_type": self._mem_type,
                "device": self._dev, "base": self._base, "length": self._num_pages * self._page_bytes,
                "page_bytes": self._page_bytes, "num_pages": self._num_pages,
                "nixl_md": base64.b64encode(bytes(blob)).decode("ascii"),
            })

    def add_peer(self, peer_metadata: bytes) -> str:
        raw = bytes(peer_metadata)
        md = decode_metadata(raw, self.backend)
        name = str(md["name"])
        for key in ("mem_type", "device", "base", "nixl_md"):
            if key not in md:
                raise ValueError(f"peer metadata lacks {key!r}")
        if md["mem_type"] not in ("DRAM", "VRAM"):
            raise ValueError(f"peer {name!r} has unsupported memory type {md['mem_type']!r}")
        page_bytes, num_pages = int(md["page_bytes"]), int(md["num_pages"])
        if page_bytes <= 0 or num_pages <= 0:
            raise ValueError(f"peer {name!r} has an empty pool ({num_pages} pages of {page_bytes} bytes)")
        try:
            nixl_md = base64.b64decode(md["nixl_md"], validate=True)
        except (ValueError, TypeError) as e:
            raise ValueError(f"peer {name!r} metadata: bad nixl_md ({e})") from None
        with self._lock:
            self._check_open()
            if name == self.name:
                raise ValueError(f"peer metadata is this transport's own ({name!r})")
            if self._buffer is not None and page_bytes != self._page_bytes:
                raise ValueError(f"peer {name!r} has page_bytes={page_bytes}, "
                                 f"local pool has {self._page_bytes}")
            old = self._peers.get(name)
            if old is not None:
                if old.raw == raw:
                    return name
                self._drop_peer(old)  # the peer restarted: new memory, new connection
            loaded = self._agent.add_remote_agent(nixl_md)
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self._agent.remove_remote_agent(loaded)
                raise ValueError(f"peer metadata names {name!r} but its NIXL blob is agent {loaded!r}")
            try:
                dlist = self._agent.prep_xfer_dlist(
                    name, _page_descs(int(md["base"]), page_bytes, num_pages, int(md["device"]),
                                      self._dlist_form), md["mem_type"])
            except Exception:
                self._agent.remove_remote_agent(name)
                raise
            self._peers[name] = _Peer(name, raw, num_pages, page_bytes, md["mem_type"], dlist)
            return name

    def _drop_peer(self, peer: _Peer) -> None:
        self._peers.pop(peer.name, None)
        for what, fn in (("descriptor list", peer.dlist.release),
                         ("remote agent", lambda: self._agent.remove_remote_agent(peer.name))):
            try:
                fn()
            except Exception as e:
                log.warning("dropping peer %r: releasing %s failed: %s", peer.name, what, _err(e))

    def remove_peer(self, name: str) -> None:
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and not self._closed:
                self._drop_peer(peer)

    def peers(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    # ---- data path ----------------------------------------------------------------------------
    def write_pages(self, peer: str, src_pages: np.ndarray, dst_pages: np.ndarray,
                    notif: bytes) -> TransferHandle:
        notif = check_notif(notif)
        with self._lock:
            self._check_open()
            if self._local_dlist is None:
                raise RuntimeError("register_pool before write_pages")
            p = self._peers.get(peer)
            if p is None:
                raise ValueError(f"unknown peer {peer!r} (known: {sorted(self._peers)})")
            src, dst = check_pages(src_pages, dst_pages, self._num_pages, p.num_pages, peer)
            if src.size == 0:
                try:
                    self._agent.send_notif(peer, notif)
                except Exception as e:
                    self._saw_error = True
                    return CompletedHandle(error=_err(e))
                return CompletedHandle()
            try:
                xfer = self._agent.make_prepped_xfer("WRITE", self._local_dlist, src, p.dlist, dst,
                                                     notif_msg=notif)
            except Exception as e:
                self._saw_error = True
                return CompletedHandle(error=_err(e))
            handle = NixlHandle(self, xfer, "pending", None)
            self._handles.add(handle)
            try:
                status = self._agent.transfer(xfer)  # blocks for a host-memory copy, GIL released
            except Exception as e:
                handle._fail(_err(e))
                return handle
            if status == "DONE":
                handle._state = "done"
            elif status == "ERR":
                handle._fail("NIXL failed to post the transfer")
            return handle

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._agent.get_new_notifs()
            except Exception as e:
                log.debug("progress while closing: %s", _err(e))
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            got = self._agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for sender, msgs in got.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((sender, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for h in list(self._handles):
                h.release()
            for p in list(self._peers.values()):
                self._drop_peer(p)
            # Let UCX finish purging endpoints: destroying the worker right after a peer failed
            # (requests still queued on the dead endpoint) trips a UCX assertion (abort).
            self._drain(0.2 if self._saw_error else 0.02)
            if self._local_dlist is not None:
                try:
                    self._local_dlist.release()
                except Exception as e:
                    log.warning("releasing local descriptor list failed: %s", _err(e))
            if self._reg is not None:
                try:
                    self._agent.deregister_memory(self._reg)
                except Exception as e:
                    log.warning("deregistering the pool failed: %s", _err(e))
            self._closed = True
            self._local_dlist = self._reg = self._buffer = None
            self._agent = None  # the C++ agent goes away with the last reference
