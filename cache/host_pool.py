"""Bounded host (CPU) KV pool for retracted requests: one buffer allocated at start-up.

Rows are whole device pages (page-major layout: a page is every layer's K and V for
``page_size`` tokens), so an offload is a few large copies. The buffer is pinned when CUDA is
present; on CPU-only torch ``pin_memory`` raises, so it is allocated by numpy (transparent huge
pages; ~2x faster copies than a torch-allocated buffer on these machines) and wrapped with
``torch.from_numpy``. Host pages have their own ``PageAllocator``: free + held == total.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cache.page_allocator import PageAllocator


@dataclass
class HostKV:
    """A retracted request's KV in the host pool: ``pages[i]`` holds the i-th device row that was
    offloaded. ``swa_index``: the logical pages whose SWA KV is among them (sliding-window
    hybrids: rows of the full pages come first, then those of these SWA pages). ``first_page``:
    the logical page of the first full row; the pages before it stayed on the device (a radix
    prefix that another request holds too, ``cache.prefix_share.park``)."""

    pages: list[int]
    num_tokens: int
    swa_index: list[int] = field(default_factory=list)
    first_page: int = 0


def _runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """Split paired index lists into ``(a0, b0, length)`` runs where both advance by one."""
    runs, i = [], 0
    while i < len(a):
        j = i + 1
        while j < len(a) and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        runs.append((a[i], b[i], j - i))
        i = j
    return runs


Gather = Callable[[torch.Tensor, list[int]], torch.Tensor]


class HostKVPool:
    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> None:
        self.num_pages = num_pages
        self.page_numel = int(np.prod(page_shape))
        self.allocator = PageAllocator(max(num_pages, 1))
        if num_pages == 0:
            self.allocator.alloc(1)  # a zero-size pool: nothing can ever be allocated
        shape = (max(num_pages, 1), self.page_numel)
        if pinned:
            self.buffer = torch.empty(shape, dtype=dtype, pin_memory=True)
        else:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.uint16
            arr = np.empty(shape, dtype=np_dtype)
            self.buffer = torch.from_numpy(arr).view(dtype) if dtype == torch.bfloat16 else torch.from_numpy(arr)
        self.page_bytes = self.page_numel * self.buffer.element_size()

    @classmethod
    def for_device_pool(cls, device_buffer: torch.Tensor, budget_bytes: int) -> HostKVPool:
        page_shape = tuple(device_buffer.shape[1:])
        page_bytes = int(np.prod(page_shape)) * device_buffer.element_size()
        pinned = torch.cuda.is_available()
        return cls(budget_bytes // page_bytes, page_shape, device_buffer.dtype, pinned)

    def num_free(self) -> int:
        return 0 if self.num_pages == 0 else self.allocator.num_free()

    def can_hold(self, n_pages: int) -> bool:
        return n_pages <= self.num_free()

    def offload(
        self,
        device_buffer: torch.Tensor,
        dev_pages: list[int],
        num_tokens: int,
        stream: torch.cuda.Stream | None = None,
        gather: Gather | None = None,
    ) -> HostKV:
        """Copy device pages into fresh host pages. On CUDA, ``gather(buffer, pages)`` (the Triton
        page gather) packs the scattered pages first, and with ``stream`` the copies are queued
        there: the caller must sync that stream before reusing ``dev_pages``."""
        host_pages = self.allocator.alloc(len(dev_pages))
        dev = device_buffer.view(device_buffer.shape[0], -1)
        if device_buffer.is_cuda:
            if gather is None:
                raise ValueError("offload from a CUDA pool needs a page gather function")
            self._offload_cuda(device_buffer, dev_pages, host_pages, stream, gather)
        else:
            for d0, h0, n in _runs(dev_pages, host_pages):
                self.buffer[h0 : h0 + n].copy_(dev[d0 : d0 + n])
        return HostKV(host_pages, num_tokens)

    def _offload_cuda(
        self,
        device_buffer: torch.Tensor,
        dev_pages: list[int],
        host_pages: list[int],
        stream: torch.cuda.Stream | None,
        gather: Gather,
    ) -> None:
        """Gather the (scattered) device pages into one staging tensor, then async DMA into the
        pinned host rows, all on ``stream``, after the work already queued on the current stream
        (the forward pass that wrote the KV)."""
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            staging = gather(device_buffer, dev_pages)
            pos = 0
            for h0, _, n in _runs(host_pages, host_pages):
                self.buffer[h0 : h0 + n].copy_(staging[pos : pos + n], non_blocking=True)
                pos += n
            # staging was allocated on ``stream``: the caching allocator orders its reuse after the DMA

    def load(self, device_buffer: torch.Tensor, kv: HostKV, dev_pages: list[int]) -> None:
        """Copy ``kv`` back into ``dev_pages`` (same count) and free its host pages."""
        dev = device_buffer.view(device_buffer.shape[0], -1)
        for h0, d0, n in _runs(kv.pages, dev_pages):
            dev[d0 : d0 + n].copy_(self.buffer[h0 : h0 + n], non_blocking=dev.is_cuda)
        if dev.is_cuda:
            torch.cuda.current_stream().synchronize()
        self.free(kv)

    def free(self, kv: HostKV) -> None:
        self.allocator.free(kv.pages)
        kv.pages = []

    def used_pages(self) -> int:
        return 0 if self.num_pages == 0 else self.allocator.num_used()

    def check_integrity(self, held: list[HostKV]) -> None:
        """free + held by retracted requests == total."""
        if self.num_pages == 0:
            return
        self.allocator.check_integrity()
        n_held = sum(len(k.pages) for k in held)
        assert self.allocator.num_free() + n_held == self.num_pages, (
            f"host pool leak: free {self.allocator.num_free()} + held {n_held} != {self.num_pages}"
        )


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
