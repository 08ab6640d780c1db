"""Write new tokens' K/V into the page-major KV pool (Triton on CUDA, torch elsewhere)."""

from __future__ import annotations

import torch

from cache.page_allocator import ceil_div
from engine.kernels._dispatch import next_pow2, resolve_backend, use_interpreter
from engine.kernels.reference import store_kv_torch


def _check_store_args(
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Validate the shapes ``store_kv`` documents: ValueError naming the mismatch."""
    n, kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_layer.dim() != 4 or tuple(k_layer.shape[2:]) != (kv_heads, head_dim):
        raise ValueError(f"k_layer {tuple(k_layer.shape)} does not fit k {tuple(k.shape)}")
    if v_layer.shape != k_layer.shape:
        raise ValueError(f"v_layer {tuple(v_layer.shape)} differs from k_layer {tuple(k_layer.shape)}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")


def store_kv(
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Write ``k``/``v`` into one layer of the KV pool at flat ``slots`` (in place).

    Shapes/dtypes:
    - ``k_layer``/``v_layer``: ``[num_pages, page_size, kv_heads, head_dim]`` views of the pool
      (e.g. ``KVPool.k_layer(l)``); any strides -- they are passed to the kernel, never assumed
      contiguous.
    - ``slots``: integer ``[n_tokens]``; slot ``s`` is page ``s // page_size``, offset
      ``s % page_size``. Negative slots are padding and are skipped.
    - ``k``/``v``: ``[n_tokens, kv_heads, head_dim]``, any strides and float dtype; values are
      cast to the pool dtype.
    Invariants: non-negative slots are unique and ``< num_pages * page_size`` (not checked on
    the Triton path: an out-of-range slot writes out of bounds).
    ``backend``: ``None``/``"auto"`` (Triton iff all tensors are on CUDA), ``"torch"`` or
    ``"triton"`` (on CPU tensors this runs the Triton interpreter; used by tests).
    """
    _check_store_args(k_layer, v_layer, slots, k, v)
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    if resolve_backend(backend, k_layer, v_layer, slots, k, v) == "torch":
        store_kv_torch(k_layer, v_layer, slots, k, v)
        return

    from engine.kernels._triton_kernels import get_kernel

    if slots.dtype not in (torch.int32, torch.int64):
        slots = slots.long()
    slots = slots.contiguous()
    kernel = get_kernel("store_kv", use_interpreter(k_layer, v_layer, slots, k, v))
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(kv_heads), max(1, 4096 // block_d))
    grid = (n, ceil_div(kv_heads, block_h))
    kernel[grid](
        k,
        v,
        k_layer,
        v_layer,
        slots,
        *k.stride(),
        *v.stride(),
        *k_layer.stride(),
        *v_layer.stride(),
        PAGE_SIZE=k_layer.shape[1],
        NUM_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
