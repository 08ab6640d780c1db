"""Whole-page copies between the page-major KV pool and a contiguous staging tensor.

A page is ``buffer[p]`` (contiguous, ``num_layers * 2 * page_size * kv_heads * head_dim``
elements for ``KVPool.buffer``); staging rows are pages flattened. Used by CPU offload and KV
transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.page_allocator import ceil_div
from engine.kernels._dispatch import resolve_backend, use_interpreter
from engine.kernels.reference import _check_pages_buffer, gather_pages_torch, scatter_pages_torch

_BLOCK = 2048
_MAX_GRID_Y = 65535


def _page_ids(page_ids: torch.Tensor | Sequence[int], buffer: torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(page_ids, dtype=torch.long, device=buffer.device).reshape(-1)
    return ids.contiguous()


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, numel: int, gather: bool) -> None:
    from engine.kernels._triton_kernels import get_kernel

    blocks = ceil_div(numel, _BLOCK)
    if blocks > _MAX_GRID_Y:
        raise ValueError(f"page of {numel} elements exceeds the copy kernel's grid limit")
    kernel = get_kernel("copy_pages", use_interpreter(src, dst, ids))
    kernel[(ids.numel(), blocks)](src, dst, ids, numel, src.stride(0), dst.stride(0), GATHER=gather, BLOCK=_BLOCK)


def gather_pages(
    buffer: torch.Tensor,
    page_ids: torch.Tensor | Sequence[int],
    out: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Copy pages ``buffer[page_ids[i]]`` into row i of a ``[n, page_numel]`` staging tensor.

    - ``buffer``: ``[num_pages, ...]`` (e.g. ``KVPool.buffer``), each ``buffer[p]`` contiguous
      with ``page_numel`` elements; the page stride may be anything.
    - ``page_ids``: ``n`` ints in ``[0, num_pages)`` (tensor or sequence; moved to buffer's
      device as int64). Not bounds-checked on the Triton path.
    - ``out``: optional ``[n, page_numel]`` of buffer's dtype and device with contiguous rows.
    Returns ``out`` or a new contiguous ``[n, page_numel]`` tensor of buffer's dtype/device.
    ``backend``: ``None``/``"auto"``, ``"torch"`` or ``"triton"`` (interpreter on CPU).
    """
    numel = _check_pages_buffer(buffer)
    ids = _page_ids(page_ids, buffer)
    n = ids.numel()
    if out is not None:
        if out.shape != (n, numel) or out.dtype != buffer.dtype:
            raise ValueError(f"out must be [{n}, {numel}] {buffer.dtype}, got {tuple(out.shape)} {out.dtype}")
        if out.stride(1) != 1:
            raise ValueError("out rows must be contiguous")
    if resolve_backend(backend, buffer, ids) == "torch":
        return gather_pages_torch(buffer, ids, out)
    if out is None:
        out = torch.empty((n, numel), dtype=buffer.dtype, device=buffer.device)
    if n:
        _launch(buffer, out, ids, numel, gather=True)
    return out


def scatter_pages(
    buffer: torch.Tensor,
    page_ids: torch.Tensor | Sequence[int],
    src: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Copy row i of staging ``src`` into page ``buffer[page_ids[i]]`` (in place).

    - ``buffer``: as in ``gather_pages``.
    - ``page_ids``: ``n`` unique ints in ``[0, num_pages)`` (duplicates: undefined winner).
    - ``src``: ``[n, page_numel]`` (or ``[n, *buffer.shape[1:]]``) with buffer's dtype; for the
      Triton path it must be on buffer's device (it is made contiguous if needed).
    ``backend``: ``None``/``"auto"``, ``"torch"`` or ``"triton"`` (interpreter on CPU).
    """
    numel = _check_pages_buffer(buffer)
    ids = _page_ids(page_ids, buffer)
    n = ids.numel()
    if src.dtype != buffer.dtype:
        raise ValueError(f"src dtype {src.dtype} != buffer dtype {buffer.dtype}")
    if src.numel() != n * numel or src.shape[0] != n:
        raise ValueError(f"src must hold {n} pages of {numel} elements, got {tuple(src.shape)}")
    if resolve_backend(backend, buffer, ids, src) == "torch":
        scatter_pages_torch(buffer, ids, src)
        return
    if n:
        _launch(src.reshape(n, numel).contiguous(), buffer, ids, numel, gather=False)
