"""KV page transport: one-sided page writes from a prefill pool into a decode pool, plus notifications.

Both sides own a page-major KV pool (``cache/kv_pool.py``): one contiguous tensor whose page ``i``
is ``buffer[i]``, a block of ``page_bytes`` bytes. The *initiator* (prefill worker) writes pages of
its pool into pages of the *target's* (decode worker's) pool, which it addresses by page id. The
target takes no part in the copy; it learns that a request's pages are in place from the
notification that the initiator attaches to the write, which it reads with ``poll_notifs``.

Contract shared by every backend (``NixlTransport``, ``UcxxTransport``, ``LoopbackTransport``; the
ucxx backend's deadline and its copy-on-the-target timing are described in its module). Build one
with ``transfer.factory.create_transport``; this module imports no backend.

* ``register_pool`` once, before ``local_metadata``/``add_peer``/``write_pages``. The buffer must
  be contiguous, ``buffer[0]`` must be exactly ``page_bytes`` bytes, and it must stay alive (and
  not be reallocated) until ``close``.
* ``local_metadata()`` is an opaque ``bytes`` blob (JSON; never pickle) that the peer passes to
  ``add_peer``. It carries the agent name, the pool's base address, length, device, memory type,
  page size in bytes and page count, plus the backend's own connection blob.
* ``add_peer`` is idempotent: the same metadata again returns the same name and does nothing;
  new metadata under a known name (the peer restarted) replaces the old connection. Both pools
  must have the same ``page_bytes`` (``ValueError`` otherwise).
* ``write_pages(peer, src_pages, dst_pages, notif)`` copies local page ``src_pages[i]`` onto the
  peer's page ``dst_pages[i]`` for every ``i`` and then delivers ``notif`` to the peer: once the
  target sees ``notif`` in ``poll_notifs``, every page of that write is in its pool. It may block
  for the duration of the copy (backends release the GIL while copying), so serving code calls it
  from a transfer thread. An empty page list is allowed and only sends ``notif``. The source
  pages must be final when it is called (on CUDA: synchronize the stream that wrote them).
  Writing the pages a request still owns is the caller's business: the transport neither
  allocates nor frees pages.
  Bad arguments raise ``ValueError`` naming the problem: unknown peer, page ids out of range (on
  either side), different lengths, non-1-D or non-integer arrays, duplicate destination pages.
  Transport failures (dead peer, lost connection) never raise and never hang: the returned
  handle reports ``"error"`` and ``handle.error`` says why.
* ``TransferHandle.poll()`` is non-blocking and returns ``"pending"``, ``"done"`` or ``"error"``
  (terminal states stick). ``wait(timeout)`` polls until a terminal state or the timeout and
  returns the last state (``"pending"`` on timeout). ``release()`` frees backend resources (and
  cancels a pending write where the backend can: its notification is then normally not
  delivered and the destination pages hold undefined bytes); it is idempotent and implied by
  ``close``.
  ``"done"`` means the data is in the target's pool and the notification is on its way.
* ``poll_notifs()`` is non-blocking and returns ``[(peer_name, notif), ...]`` received since the
  last call, each notification exactly once, in order per peer (no order across peers). The
  target must call it regularly: with NIXL it is also what progresses the target's side of the
  connection, and an initiator's write stays ``"pending"`` until the target has polled (the data
  is already in place by then; only the completion handshake waits).
* A peer that is alive but never polls (hung, stopped) is not an error: writes to it stay
  ``"pending"``; use ``wait(timeout)`` and the control plane's leases.
* The target is never told that an initiator died (a write either completed with its
  notification or never notifies); leases in the control plane handle that.
* ``close()`` releases everything; the object is unusable afterwards (``RuntimeError``).
  Idempotent.
* ``WARMUP_NOTIF``: an initiator that just added a peer writes no pages with this notification,
  so that the connection's setup (UCX wireup; ucxx's endpoint and lanes) happens then rather than
  in the first transfer; targets drop it.

Methods are thread-safe (one lock per transport); a write holds that lock while it copies.
"""

from __future__ import annotations

import abc
import json
import time
from typing import Literal

import numpy as np
import torch

TransferState = Literal["pending", "done", "error"]

METADATA_FORMAT = "pdserve-kv-transport/1"

#: The notification of a page-less write that only sets a new connection up (module docstring).
WARMUP_NOTIF = b"pdserve-kv-transport/warmup"


class TransferHandle(abc.ABC):
    """One started write. Poll it to completion, then ``release`` it."""

    #: Human-readable reason once ``poll`` has returned ``"error"``; ``None`` otherwise.
    error: str | None = None

    @abc.abstractmethod
    def poll(self) -> TransferState:
        """Non-blocking state: ``"pending"``, ``"done"`` or ``"error"`` (terminal states stick)."""

    def wait(self, timeout: float | None = None) -> TransferState:
        """Poll until ``"done"``/``"error"`` or ``timeout`` seconds; return the last state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0
        while True:
            state = self.poll()
            if state != "pending":
                return state
            if deadline is not None and time.monotonic() >= deadline:
                return state
            # Spin briefly (a shared-memory copy completes in a few ms), then back off to 1 ms.
            delay = min(0.001, delay * 2 if delay else 0.00005)
            time.sleep(delay)

    @abc.abstractmethod
    def release(self) -> None:
        """Free backend resources (cancels a pending write where possible). Idempotent."""

    def __enter__(self) -> TransferHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CompletedHandle(TransferHandle):
    """A handle born terminal: ``"done"``, or ``"error"`` with a reason."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error

    def poll(self) -> TransferState:
        return "error" if self.error is not None else "done"

    def release(self) -> None:
        pass


class KVTransport(abc.ABC):
    """Interface of a KV page transport. See the module docstring for the full contract."""

    #: Short backend id written into the metadata ("nixl", "ucxx", "loopback").
    backend: str = ""
    #: How often a worker with nothing else to do polls its pending writes and notifications
    #: (seconds). A backend whose transfers complete without this process (NIXL) tolerates a few
    #: ms; 0 means the transfers only progress while polled (ucxx without a progress thread).
    poll_interval_s: float = 0.002
    #: True where a posted write's notification leaves only from later status calls (``poll``), not
    #: with the data: the writer should keep polling a write it posted until it is done, or its
    #: target hears of the pages only at the writer's next scheduler turn (NIXL: its UCX progress
    #: runs only inside our calls; ``prefill_worker.kv_sender``).
    notifies_on_poll: bool = False

    def __init__(self, name: str) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"transport name must be a non-empty str, got {name!r}")
        self.name = name

    @abc.abstractmethod
    def register_pool(self, buffer: torch.Tensor, page_bytes: int) -> None:
        """Register the whole pool once (page ``i`` = ``buffer[i]``, ``page_bytes`` bytes each)."""

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` (JSON bytes, no pickle). Needs a registered pool."""

    @abc.abstractmethod
    def add_peer(self, peer_metadata: bytes) -> str:
        """Connect to a peer from its ``local_metadata``; return its name. Idempotent."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (no-op if unknown). Later writes to it raise ``ValueError``."""

    @abc.abstractmethod
    def write_pages(self, peer: str, src_pages: np.ndarray, dst_pages: np.ndarray, notif: bytes) -> TransferHandle:
        """One-sided write of local pages ``src_pages`` onto the peer's ``dst_pages``, then ``notif``."""

    @abc.abstractmethod
    def poll_notifs(self) -> list[tuple[str, bytes]]:
        """Non-blocking: notifications received since the last call, as ``(peer name, notif)``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything. Idempotent."""

    def peers(self) -> list[str]:
        """Names of the connected peers."""
        return []

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- helpers shared by the backends ----------------------------------------------------------


def pool_geometry(buffer: torch.Tensor, page_bytes: int) -> tuple[int, int]:
    """Validate a page-major pool; return ``(num_pages, total_bytes)``."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"pool buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dim() < 1 or buffer.shape[0] == 0:
        raise ValueError(f"pool buffer needs at least one page, got shape {tuple(buffer.shape)}")
    if not buffer.is_contiguous():
        raise ValueError("pool buffer must be contiguous")
    page_bytes = int(page_bytes)
    actual = buffer[0].numel() * buffer.element_size()
    if page_bytes <= 0 or page_bytes != actual:
        raise ValueError(
            f"page_bytes={page_bytes} but buffer[0] holds {actual} bytes "
            f"(pool shape {tuple(buffer.shape)}, {buffer.dtype})"
        )
    return int(buffer.shape[0]), int(buffer.shape[0]) * page_bytes


def device_of(buffer: torch.Tensor) -> tuple[str, int]:
    """``("DRAM", 0)`` for host memory, ``("VRAM", cuda index)`` for CUDA memory."""
    if buffer.device.type == "cpu":
        return "DRAM", 0
    if buffer.device.type == "cuda":
        return "VRAM", int(buffer.device.index if buffer.device.index is not None else torch.cuda.current_device())
    raise ValueError(f"unsupported pool device {buffer.device}")


def as_page_ids(pages, what: str) -> np.ndarray:
    """A 1-D contiguous int32 copy-or-view of ``pages``; ``ValueError`` for anything else."""
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().cpu().numpy()
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be integer page ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{what} has ids outside int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether a 1-D id array repeats an id. Sorts instead of ``np.unique``, whose first call
    imports ``numpy.ma`` (compiled on the spot where numpy ships no bytecode): ~0.1 s holding the
    GIL on a transfer thread, which stalled a decode worker's forward at its first migration."""
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


def check_pages(src_pages, dst_pages, n_src: int, n_dst: int, peer: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate one write's page lists against both pools' page counts."""
    src = as_page_ids(src_pages, "src_pages")
    dst = as_page_ids(dst_pages, "dst_pages")
    if src.size != dst.size:
        raise ValueError(f"src_pages and dst_pages have different lengths ({src.size} vs {dst.size})")
    if src.size:
        if src.min() < 0 or src.max() >= n_src:
            bad = int(src[(src < 0) | (src >= n_src)][0])
            raise ValueError(f"src page id {bad} out of range: the local pool has {n_src} pages")
        if dst.min() < 0 or dst.max() >= n_dst:
            bad = int(dst[(dst < 0) | (dst >= n_dst)][0])
            raise ValueError(f"dst page id {bad} out of range: peer {peer!r} has {n_dst} pages")
        if has_duplicates(dst):
            raise ValueError("dst_pages has duplicate page ids")
    return src, dst


def check_notif(notif) -> bytes:
    if isinstance(notif, str):
        notif = notif.encode()
    if not isinstance(notif, (bytes, bytearray, memoryview)):
        raise ValueError(f"notif must be bytes, got {type(notif).__name__}")
    return bytes(notif)


def encode_metadata(fields: dict) -> bytes:
    return json.dumps({"format": METADATA_FORMAT, **fields}, sort_keys=True).encode()


def decode_metadata(blob: bytes, backend: str) -> dict:
    """Parse a peer's ``local_metadata``; ``ValueError`` if it is not ours or is for another backend."""
    try:
        md = json.loads(bytes(blob).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"peer metadata is not transport JSON: {e}") from None
    if not isinstance(md, dict) or md.get("format") != METADATA_FORMAT:
        raise ValueError(
            f"peer metadata format {md.get('format') if isinstance(md, dict) else None!r}, expected {METADATA_FORMAT!r}"
        )
    if md.get("backend") != backend:
        raise ValueError(f"peer metadata is for backend {md.get('backend')!r}, this transport is {backend!r}")
    for key in ("name", "page_bytes", "num_pages"):
        if key not in md:
            raise ValueError(f"peer metadata lacks {key!r}")
    return md
