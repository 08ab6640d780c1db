"""Zeroed tensors for KV pools, on transparent huge pages where the host allows them.

Decode attention reads a request's KV page by page from all over the pool: with 4 KiB pages every
16-token page costs TLB misses, which 2 MiB pages mostly avoid.
Linux in its default ``madvise`` THP mode gives huge pages only to ranges that ask, so a CPU pool
asks (``madvise(MADV_HUGEPAGE)``) before its pages are first touched. Anything else (CUDA, a host
without THP or without libc) gets a plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


@functools.lru_cache(maxsize=1)
def _madvise():
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    fn = ctypes.CDLL(path, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned interior of ``t``'s storage. True if the kernel
    took the advice (a range under 2 MiB, a non-CPU tensor or a refusal gives False; never raises)."""
    fn = _madvise()
    if fn is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return False
    if fn(lo, hi - lo, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU the storage is advised onto huge pages before the zeros
    touch it (so the first touch already faults in 2 MiB pages)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
