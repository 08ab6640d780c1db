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
* ``copy_threads=N`` (default 0; the decode worker's migration transport uses
  ``--migration-copy-threads``): NIXL's UCX thread pool (``num_threads``/``split_batch_size``
  backend parameters, N dedicated UCX workers each on its own thread). A write of at least
  ``split_pages`` descriptors is cut into N chunks copied in parallel (on one host: N concurrent CMA
  copies, which a single ``process_vm_writev`` stream cannot saturate). NIXL sends the notification
  only after every chunk completed, from a status call, so for host-to-host writes ``write_pages``
  waits for the chunks (as it blocks for a single-threaded copy; at most ``HOST_COPY_WAIT_S``) and
  the notification leaves as the last page lands. The agent then runs in NIXL's RW sync mode (UCX
  workers in multi-thread mode), since ``poll_notifs`` progresses the pool's workers from the
  caller's thread.

Metadata (``local_metadata``) is JSON: name, memory type, device, base, length, page size, page
count and NIXL's own agent metadata blob as base64. No pickle anywhere.
"""

from __future__ import annotations

import base64
import importlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transfer.kv_transport import CompletedHandle, TransferHandle
from transfer.transport_base import (
    PeerRecord,
    PendingHandle,
    RemoteTransportBase,
    err_text,
    peer_pool_size,
)

log = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl._api", "nixl")

#: ``copy_threads``: a write of fewer descriptors than this stays on the caller's thread.
DEFAULT_SPLIT_PAGES = 8
#: ``copy_threads``: how long ``write_pages`` waits for a host-to-host write's chunks (then ``poll`` does).
HOST_COPY_WAIT_S = 1.0


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


def _page_descs(base: int, page_bytes: int, num_pages: int, dev: int, form: str) -> np.ndarray:
    if form == "strided":
        return np.array([[base, page_bytes, dev, page_bytes, num_pages]], dtype=np.uint64)
    descs = np.empty((num_pages, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base) + np.arange(num_pages, dtype=np.uint64) * np.uint64(page_bytes)
    descs[:, 1] = page_bytes
    descs[:, 2] = dev
    return descs


@dataclass
class _Peer(PeerRecord):
    """A peer loaded into the NIXL agent, with its prepared page descriptor list."""

    mem_type: str
    dlist: Any  # nixl_prepped_dlist_handle


class NixlHandle(PendingHandle):
    """A posted NIXL WRITE. ``poll`` progresses the agent's UCX worker."""

    def __init__(self, transport: NixlTransport, xfer) -> None:
        super().__init__(transport)
        self._xfer = xfer

    def _advance(self) -> None:
        t = self._transport
        if self._xfer is None:
            self._fail("transport closed before the write completed")
            return
        try:
            status = t._agent.check_xfer_state(self._xfer)
        except Exception as e:  # nixlRemoteDisconnectError and friends
            self._fail(err_text(e))
            return
        if status == "DONE":
            self._state = "done"
        elif status == "ERR":
            self._fail("NIXL reported the transfer failed")

    def _on_fail(self) -> None:
        self._transport._saw_error = True

    def _release_resources(self) -> None:
        xfer, self._xfer = self._xfer, None
        if xfer is None:
            return
        self._transport._handles.discard(self)
        try:
            xfer.release()  # NIXL cancels a pending transfer; may refuse (then it is leaked to the agent)
        except Exception as e:
            log.warning("releasing NIXL transfer handle failed: %s", err_text(e))


class NixlTransport(RemoteTransportBase):
    """NIXL/UCX implementation of ``KVTransport`` (DRAM or VRAM pools)."""

    backend = "nixl"
    notifies_on_poll = True

    def __init__(
        self,
        name: str,
        *,
        dlist_form: str = "list",
        num_workers: int = 1,
        capture_telemetry: bool = False,
        copy_threads: int = 0,
        split_pages: int = DEFAULT_SPLIT_PAGES,
    ) -> None:
        """``copy_threads`` > 0: NIXL's UCX thread pool (see the module docstring) copies a write of at
        least ``split_pages`` descriptors in that many parallel chunks; 0 (default): the caller's
        thread copies every write."""
        super().__init__(name)
        if dlist_form not in ("list", "strided"):
            raise ValueError(f"dlist_form must be 'list' or 'strided', got {dlist_form!r}")
        if not 0 <= int(copy_threads) <= 64:
            raise ValueError(f"copy_threads must be 0..64, got {copy_threads!r}")
        if int(split_pages) < 1:
            raise ValueError(f"split_pages must be >= 1, got {split_pages!r}")
        nixl = _nixl()
        self._dlist_form = dlist_form
        self.copy_threads = int(copy_threads)
        self._handles: weakref.WeakSet[NixlHandle] = weakref.WeakSet()
        self._saw_error = False
        self._reg = None
        self._local_dlist = None
        extra = {}
        if self.copy_threads:  # UCX workers in multi-thread mode: ours progress the pool's workers too
            extra["sync_mode"] = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
        config = nixl.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            capture_telemetry=capture_telemetry,
            **extra,
        )
        self._agent = nixl.nixl_agent(name, config)
        if "UCX" not in self._agent.get_plugin_list():
            raise RuntimeError(f"NIXL has no UCX plugin (plugins: {self._agent.get_plugin_list()})")
        params = {"ucx_error_handling_mode": "peer", "num_workers": str(int(num_workers))}
        if self.copy_threads:
            params.update(
                num_threads=str(self.copy_threads),
                split_batch_size=str(int(split_pages)),
                num_workers=str(max(int(num_workers), self.copy_threads + 1)),
            )
        self._agent.create_backend("UCX", params)

    # ---- setup --------------------------------------------------------------------------------
    @property
    def agent(self):
        """The underlying ``nixl_agent`` (for telemetry/diagnostics; hold no long references)."""
        return self._agent

    def _register(
        self, buffer: torch.Tensor, page_bytes: int, num_pages: int, length: int, mem_type: str, dev: int
    ) -> None:
        base = buffer.data_ptr()
        reg = self._agent.register_memory([(base, length, dev, "")], mem_type)
        try:
            local = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _page_descs(base, page_bytes, num_pages, dev, self._dlist_form), mem_type
            )
        except Exception:
            self._agent.deregister_memory(reg)
            raise
        self._reg, self._local_dlist = reg, local

    def _metadata_extra(self) -> dict:
        blob = self._agent.get_agent_metadata()
        return {"nixl_md": base64.b64encode(bytes(blob)).decode("ascii")}

    def _parse_peer(self, name: str, md: dict) -> tuple[int, int, bytes]:
        for key in ("mem_type", "device", "base", "nixl_md"):
            if key not in md:
                raise ValueError(f"peer metadata lacks {key!r}")
        if md["mem_type"] not in ("DRAM", "VRAM"):
            raise ValueError(f"peer {name!r} has unsupported memory type {md['mem_type']!r}")
        page_bytes, num_pages = peer_pool_size(name, md)
        try:
            nixl_md = base64.b64decode(md["nixl_md"], validate=True)
        except (ValueError, TypeError) as e:
            raise ValueError(f"peer {name!r} metadata: bad nixl_md ({e})") from None
        return page_bytes, num_pages, nixl_md

    def _connect_peer(self, name: str, raw: bytes, md: dict, page_bytes: int, num_pages: int, blob: bytes) -> _Peer:
        loaded = self._agent.add_remote_agent(blob)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise ValueError(f"peer metadata names {name!r} but its NIXL blob is agent {loaded!r}")
        try:
            dlist = self._agent.prep_xfer_dlist(
                name,
                _page_descs(int(md["base"]), page_bytes, num_pages, int(md["device"]), self._dlist_form),
                md["mem_type"],
            )
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        return _Peer(name, raw, num_pages, page_bytes, md["mem_type"], dlist)

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """Release the peer's descriptor list and remote agent; never raises. ``why`` is unused:
        NIXL holds the state of the peer's pending writes, their ``poll`` asks it."""
        self._peers.pop(peer.name, None)
        for what, fn in (
            ("descriptor list", peer.dlist.release),
            ("remote agent", lambda: self._agent.remove_remote_agent(peer.name)),
        ):
            try:
                fn()
            except Exception as e:
                log.warning("dropping peer %r: releasing %s failed: %s", peer.name, what, err_text(e))

    # ---- data path ----------------------------------------------------------------------------
    def _write(self, peer: _Peer, src: np.ndarray, dst: np.ndarray, notif: bytes) -> TransferHandle:
        if src.size == 0:
            try:
                self._agent.send_notif(peer.name, notif)
            except Exception as e:
                self._saw_error = True
                return CompletedHandle(error=err_text(e))
            return CompletedHandle()
        try:
            xfer = self._agent.make_prepped_xfer("WRITE", self._local_dlist, src, peer.dlist, dst, notif_msg=notif)
        except Exception as e:
            self._saw_error = True
            return CompletedHandle(error=err_text(e))
        handle = NixlHandle(self, xfer)
        self._handles.add(handle)
        try:
            status = self._agent.transfer(xfer)  # blocks for a host-memory copy, GIL released
        except Exception as e:
            handle._fail(err_text(e))
            return handle
        if status == "DONE":
            handle._state = "done"
        elif status == "ERR":
            handle._fail("NIXL failed to post the transfer")
        elif self.copy_threads and self._mem_type == "DRAM" and peer.mem_type == "DRAM":
            self._finish_host_copy(handle)
        return handle

    def _finish_host_copy(self, handle: NixlHandle) -> None:
        """Wait (at most ``HOST_COPY_WAIT_S``) for the copy threads' chunks of a host-to-host write,
        as a single-threaded write blocks for its copy: NIXL sends the notification only from a
        status call after the last chunk, so without this the target would hear of the pages at
        the caller's next ``poll`` (a scheduler step later), not when they landed."""
        deadline = time.monotonic() + HOST_COPY_WAIT_S
        while True:
            handle._advance()
            if handle._state != "pending" or time.monotonic() >= deadline:
                return
            time.sleep(0.00002)

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._agent.get_new_notifs()
            except Exception as e:
                log.debug("progress while closing: %s", err_text(e))
            if time.monotonic() >= deadline:
                return
            time.sleep(0.002)

    def _take_notifs(self) -> list[tuple[str, bytes]]:
        got = self._agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for sender, msgs in got.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((sender, bytes(m)) for m in msgs)
        return out

    def _teardown(self) -> None:
        for h in list(self._handles):
            h.release()
        for p in list(self._peers.values()):
            self._drop_peer(p, "transport closed before the write completed")
        # Let UCX finish purging endpoints: destroying the worker right after a peer failed
        # (requests still queued on the dead endpoint) trips a UCX assertion (abort).
        self._drain(0.2 if self._saw_error else 0.02)
        if self._local_dlist is not None:
            try:
                self._local_dlist.release()
            except Exception as e:
                log.warning("releasing local descriptor list failed: %s", err_text(e))
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:
                log.warning("deregistering the pool failed: %s", err_text(e))
        self._local_dlist = self._reg = None
        self._agent = None  # the C++ agent goes away with the last reference
