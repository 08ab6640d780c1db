"""Wire format of the ucxx data plane: UCX tag layout and the per-write header.

ucxx (0.52) exposes two-sided tagged messaging only (no RMA keys in its Python API), so a
one-sided ``write_pages`` is emulated: the initiator sends one *header* message and then one
message per page; the target posts a receive for each page straight into its pool page when the
header arrives (no staging copy on the target). Large pages travel with UCX's rendezvous protocol:
the data stays in the initiator's pool until the target's receive is posted, then moves in one
copy (cma on one host).

Tags (64 bits): ``conn_id (32) | seq (16) | page index (16)``.

* ``conn_id`` is random per initiator connection (a new one after a reconnect or abort), never 0;
  tag 0 is reserved for headers, which are matched with the full mask.
* ``seq`` counts writes on one connection (wraps at 65,536; writes on a connection complete in
  order long before that).
* ``page index`` is the page's position in this write, so a write carries at most 65,535 pages.

Header: little-endian ``struct`` :data:`HEADER` (magic, version, name length, conn_id, seq, page
count, notification length, deadline, lanes) then the initiator's name (UTF-8), the destination page ids
(int32) and the notification bytes. ``deadline`` is the wall-clock time (``time.time()``, the
same clock for every process on a host) at which the initiator gives up on the write and aborts
the connection; a target that reads the header after it no longer posts receives into its pool.
No pickle: a fixed binary layout with a version field.

``lanes`` (version 2): 0 = every page message goes to the target's main UCX worker (the one its
metadata's ``ucx_address`` names, which also takes the header); ``L`` > 0 = page ``i`` goes to the
target's copy lane ``i % L`` (its metadata's ``ucx_lanes``, ``transfer/ucxx_lanes.py``), so L
workers pull the write's pages in parallel. An initiator uses at most as many lanes as the target
publishes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"PDKV"
VERSION = 2
HEADER_TAG = 0
MAX_PAGES_PER_WRITE = 0xFFFF
MAX_NAME_BYTES = 255
HEADER = struct.Struct("<4sHHIIIIdH")
MAX_LANES = 64


@dataclass(frozen=True)
class WriteHeader:
    """What the target needs to post the page receives of one write and deliver its notif."""

    sender: str
    conn_id: int
    seq: int
    dst_pages: np.ndarray  # int32, one per page message, in tag-index order
    notif: bytes
    deadline: float  # time.time() at which the initiator aborts the write
    lanes: int = 0  # 0: pages on the main worker; L: page i on copy lane i % L


def page_lane(index: int, lanes: int) -> int:
    """The copy lane page message ``index`` travels on (-1: the main worker)."""
    return index % lanes if lanes else -1


def page_tag(conn_id: int, seq: int, index: int) -> int:
    """The tag of page message ``index`` of write ``seq`` on connection ``conn_id``."""
    return (conn_id << 32) | ((seq & 0xFFFF) << 16) | index


def pack_header(h: WriteHeader) -> np.ndarray:
    """The header as a uint8 array (the buffer ``tag_send`` sends)."""
    name = h.sender.encode()
    if len(name) > MAX_NAME_BYTES:
        raise ValueError(f"transport name is {len(name)} bytes; at most {MAX_NAME_BYTES}")
    pages = np.ascontiguousarray(h.dst_pages, dtype="<i4")
    if pages.size > MAX_PAGES_PER_WRITE:
        raise ValueError(f"a ucxx write carries at most {MAX_PAGES_PER_WRITE} pages, got {pages.size}")
    if not 0 <= h.lanes <= MAX_LANES:
        raise ValueError(f"a ucxx write uses 0..{MAX_LANES} copy lanes, got {h.lanes}")
    fixed = HEADER.pack(
        MAGIC, VERSION, len(name), h.conn_id, h.seq & 0xFFFF, pages.size, len(h.notif), h.deadline, h.lanes
    )
    return np.frombuffer(fixed + name + pages.tobytes() + h.notif, dtype=np.uint8).copy()


def unpack_header(buf: bytes) -> WriteHeader:
    """Parse a header; ``ValueError`` saying what is wrong (bad magic, version, length)."""
    if len(buf) >= 6 and buf[:4] == MAGIC and struct.unpack_from("<H", buf, 4)[0] != VERSION:
        raise ValueError(f"ucxx header version {struct.unpack_from('<H', buf, 4)[0]}, this worker speaks {VERSION}")
    if len(buf) < HEADER.size:
        raise ValueError(f"ucxx header is {len(buf)} bytes, shorter than the fixed {HEADER.size}")
    magic, version, name_len, conn_id, seq, n_pages, notif_len, deadline, lanes = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"not a pdserve ucxx header (magic {magic!r})")
    if version != VERSION:
        raise ValueError(f"ucxx header version {version}, this worker speaks {VERSION}")
    want = HEADER.size + name_len + 4 * n_pages + notif_len
    if len(buf) != want:
        raise ValueError(f"ucxx header is {len(buf)} bytes, its fields say {want}")
    at = HEADER.size
    sender = bytes(buf[at : at + name_len]).decode()
    at += name_len
    pages = np.frombuffer(bytes(buf[at : at + 4 * n_pages]), dtype="<i4").astype(np.int32)
    at += 4 * n_pages
    if lanes > MAX_LANES:
        raise ValueError(f"ucxx header names {lanes} copy lanes; at most {MAX_LANES}")
    return WriteHeader(sender, conn_id, seq, pages, bytes(buf[at : at + notif_len]), deadline, lanes)
