"""The Python face of the C CPU kernels (built and loaded by ``engine.kernels.cpu_library``, whose
docstring lists every source): paged decode and extend attention over the KV pool and the
small-batch matmuls (``cpu_gemv.c``, ``cpu_gemm_pairs.c``), each taking torch tensors and returning
a new one, with the capability checks and thread counts their callers use. The fused per-layer ops
are wrapped by ``engine.kernels.fused``.

``paged_decode`` is the CPU decode attention of ``engine.attention.CpuBackend``: it reads each
request's keys in place from the paged pool, where the torch path gathers every request's pages
padded to the longest request and runs SDPA on the copy (at batch 32 and 300-token contexts that
path spent ~250 ms per step of SmolLM2 in attention, the kernel ~40 ms; ``pdserve bench engine``).
It reads float32 and bfloat16 pools (bfloat16 keys are widened as they are read; the query, the sums
and the output are float32). ``paged_extend`` is its prefill counterpart, tiled over query blocks.

Every wrapper calls ``load()`` for the library; callers check ``load() is not None`` (or one of the
``*_available()`` probes) first, and keep the torch or oneDNN path otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kernels.cpu_library import load, openmp_shared  # re-exported: callers reach the library here

MAX_HEAD_DIM = 1024
DTYPES = (torch.float32, torch.bfloat16)


GEMV_MAX_ROWS = 8  # cpu_gemv.c's MAX_ROWS
# How the memory-streaming kernels (decode attention, small-batch matmul) prefetch: into L1 or L2,
# each at its own distance. Speed only, never the output; the machine's faster one per kernel is
# ``engine.kernels.decode_prefetch.modes()``.
PREFETCH_L1, PREFETCH_L2 = 0, 1


@functools.lru_cache(maxsize=1)
def gemv_available() -> bool:
    """True iff this build has ``cpu_gemv.c``'s bfloat16 kernel (the CPU has AVX512-BF16)."""
    lib = load()
    return lib is not None and lib.pdserve_gemv_bf16_available() == 1


def gemv_bf16(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, prefetch: int = PREFETCH_L1
) -> torch.Tensor | None:
    """``x @ w.T + bias`` for 2-D bfloat16 ``x`` of 1..GEMV_MAX_ROWS rows (last dim contiguous) and a
    contiguous bfloat16 ``[out, in]`` ``w``, or None where the kernel does not take the shape (the
    caller then uses another path). The result is a new ``[rows, out]`` bfloat16 tensor.
    ``prefetch``: ``PREFETCH_L1`` or ``PREFETCH_L2`` (speed only)."""
    rows, out = x.shape[0], w.shape[0]
    y = torch.empty(rows, out, dtype=torch.bfloat16)
    threads = torch.get_num_threads() if openmp_shared() else 1
    rc = load().pdserve_gemv_bf16(
        x.data_ptr(),
        x.stride(0),
        w.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        w.shape[1],
        out,
        threads,
        int(prefetch),
    )
    return y if rc == 0 else None


def gemv_i8w(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, prefetch: int = PREFETCH_L1
) -> torch.Tensor | None:
    """``(x @ q.T) * scale + bias`` for 2-D bfloat16 ``x`` of 1..GEMV_MAX_ROWS rows (last dim
    contiguous), a contiguous int8 ``[out, in]`` ``q`` and float32 ``[out]`` ``scale`` (a weight-only
    int8 weight): a new ``[rows, out]`` bfloat16 tensor, or None where the kernel does not take the
    shape. The products are exact, the sums float32, the result rounded to bfloat16 once."""
    rows, out = x.shape[0], q.shape[0]
    y = torch.empty(rows, out, dtype=torch.bfloat16)
    threads = torch.get_num_threads() if openmp_shared() else 1
    rc = load().pdserve_gemv_i8w(
        x.data_ptr(),
        x.stride(0),
        q.data_ptr(),
        scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        q.shape[1],
        out,
        threads,
        int(prefetch),
    )
    return y if rc == 0 else None


PAIRS_PANEL = 64  # cpu_gemm_pairs.c's outputs per panel: a pair-panel weight has out % 64 == 0


@functools.lru_cache(maxsize=1)
def pairs_available() -> bool:
    """True iff this build has ``cpu_gemm_pairs.c``'s kernels (the CPU has AVX512-BF16)."""
    lib = load()
    return lib is not None and lib.pdserve_gemm_pairs_available() == 1


def gemm_pairs(
    x: torch.Tensor, pairs: torch.Tensor, out: int, bias: torch.Tensor | None, scale: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ W.T (* scale) + bias`` for 2-D bfloat16 ``x`` (any rows, last dim contiguous) and ``W``
    ``[out, in]`` in the pair-panel layout (``engine.cpu_linear.to_pairs``): bfloat16, or int8 with
    float32 row ``scale``. A new ``[rows, out]`` bfloat16 tensor, or None where the kernel does not
    take the shape."""
    rows = x.shape[0]
    y = torch.empty(rows, out, dtype=torch.bfloat16)
    threads = torch.get_num_threads() if openmp_shared() else 1
    b = 0 if bias is None else bias.data_ptr()
    if scale is None:
        rc = load().pdserve_gemm_pairs_bf16(
            x.data_ptr(), x.stride(0), pairs.data_ptr(), b, y.data_ptr(), rows, x.shape[1], out, threads
        )
    else:
        rc = load().pdserve_gemm_pairs_i8w(
            x.data_ptr(),
            x.stride(0),
            pairs.data_ptr(),
            scale.data_ptr(),
            b,
            y.data_ptr(),
            rows,
            x.shape[1],
            out,
            threads,
        )
    return y if rc == 0 else None


@functools.lru_cache(maxsize=1)
def panels_f32_available() -> bool:
    """True iff this build has the float32 panel kernel (``pdserve_gemm_panels_f32``; AVX-512F)."""
    lib = load()
    return lib is not None and lib.pdserve_gemm_panels_f32_available() == 1


def gemm_panels_f32(x: torch.Tensor, panels: torch.Tensor, out: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ W.T + bias`` for 2-D float32 ``x`` (any rows, last dim contiguous) and ``W`` ``[out, in]``
    in the float32 panel layout (``engine.cpu_linear.to_panels_f32``), ``bias`` None or ``[out]``
    float32 contiguous. A new ``[rows, out]`` float32 tensor (sums in input order), or None where the
    kernel does not take the shape."""
    rows = x.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)
    threads = torch.get_num_threads() if openmp_shared() else 1
    rc = load().pdserve_gemm_panels_f32(
        x.data_ptr(),
        x.stride(0),
        panels.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        rows,
        x.shape[1],
        out,
        threads,
    )
    return y if rc == 0 else None


def supports(pool_buffer: torch.Tensor) -> bool:
    """True iff ``paged_decode`` can read this ``[pages, layers, 2, P, heads, dim]`` pool."""
    return (
        pool_buffer.device.type == "cpu"
        and pool_buffer.dtype in DTYPES
        and pool_buffer.stride(-1) == 1
        and pool_buffer.shape[-1] <= MAX_HEAD_DIM
        and load() is not None
    )


# Multiply-adds one kernel thread should have before another is worth waking: torch's OpenMP workers
# are warm (spinning between ops), so a parallel region costs a few microseconds; 2^17 is ~50 us of
# one core's work on a batch read from memory (a serving step's case, not a cache-resident one).
WORK_PER_THREAD = 1 << 17


def threads_for(keys: int, heads: int, head_dim: int, available: int) -> int:
    """Threads for one call that reads ``keys`` key positions in all (summed over the batch) for
    ``heads`` query heads of ``head_dim``: one per ``WORK_PER_THREAD`` multiply-adds, at least one,
    at most ``available``; one when the kernels could not share torch's OpenMP runtime. The result
    does not change the output (each item is one thread's)."""
    if not openmp_shared():
        return 1
    return max(1, min(available, keys * heads * head_dim // WORK_PER_THREAD))


def paged_decode(
    q: torch.Tensor,
    pool_buffer: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    scale: float,
    threads: int = 1,
    prefetch: int = PREFETCH_L1,
    dot: bool = True,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` over keys ``[lo[b], hi[b])`` of request b in ``layer`` of
    the pool; ``table`` ``[B, W]`` int64 maps ``pos // P`` to a page (only entries of pages in the
    range are read); ``lo``/``hi`` int64 ``[B]``. Returns ``[B, H, D]`` float32 (zeros for an empty
    range). ``q`` may be any float dtype (it is read as float32). ``prefetch``: ``PREFETCH_L1`` or
    ``PREFETCH_L2`` (speed only). ``dot``: a bfloat16 pool takes its products in bfloat16 where
    ``decode_dot_available()`` (the query and the softmax weights rounded to bfloat16 once each, sums
    and softmax float32: ~2^-9 relative from the float32-math path, which a bfloat16 model's query
    loses nothing to; ~2x fewer instructions). ``softcap``: each scaled score ``s`` becomes
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2; None: none). Caller guarantees
    ``supports(pool_buffer)``, contiguous int64 indices and in-range pages."""
    B, H, D = q.shape
    q = q.float().contiguous()
    out = torch.empty_like(q)
    pool = _PoolView.of(pool_buffer, layer)
    load().pdserve_paged_decode(
        q.data_ptr(),
        pool.base,
        pool.bf16,
        table.data_ptr(),
        table.stride(0),
        lo.data_ptr(),
        hi.data_ptr(),
        out.data_ptr(),
        B,
        H,
        pool.kv_heads,
        D,
        *pool.geometry,
        float(scale),
        int(threads),
        int(prefetch),
        int(dot),
        float(softcap or 0.0),
    )
    return out


@dataclass(frozen=True)
class _PoolView:
    """One layer of a ``[pages, layers, 2, P, kv_heads, dim]`` pool as the kernels address it:
    base address, element type flag, kv heads and ``(P, page, V offset, token, head)`` strides."""

    base: int
    bf16: int
    kv_heads: int
    geometry: tuple[int, int, int, int, int]

    @classmethod
    def of(cls, pool_buffer: torch.Tensor, layer: int) -> _PoolView:
        _, _, _, P, kv_heads, _ = pool_buffer.shape
        s = pool_buffer.stride()
        return cls(
            pool_buffer.data_ptr() + layer * s[1] * pool_buffer.element_size(),
            int(pool_buffer.dtype == torch.bfloat16),
            kv_heads,
            (P, s[0], s[2], s[3], s[4]),
        )


# The tiled extend kernel's shape limits (cpu_extend_attention.c): head_dim a multiple of 4 vectors
# of 16 floats, at most 48 query heads per kv head.
EXTEND_DIM_MULTIPLE, EXTEND_MAX_GROUP = 64, 48


def decode_dot_available() -> bool:
    """True iff the kernels built here take bfloat16 products in ``paged_decode`` (AVX512-BF16)."""
    lib = load()
    return lib is not None and bool(lib.pdserve_decode_dot_available())


EXTEND_DOT_MAX_DIM = 512  # the bfloat16-product path's zero key row holds 512 dimensions


def extend_dot_available() -> bool:
    """True iff the kernels built here take bfloat16 products in ``paged_extend`` (AVX512-BF16)."""
    lib = load()
    return lib is not None and bool(lib.pdserve_extend_dot_available())


def extend_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """True iff ``paged_extend`` takes this attention shape."""
    return head_dim % EXTEND_DIM_MULTIPLE == 0 and num_heads // num_kv_heads <= EXTEND_MAX_GROUP


def paged_extend(
    q: torch.Tensor,
    pool_buffer: torch.Tensor,
    layer: int,
    table: torch.Tensor,
    qstart: torch.Tensor,
    pos0: torch.Tensor,
    ext: torch.Tensor,
    window: int | None,
    scale: float,
    threads: int = 1,
    dot: bool = True,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill attention of ``q`` ``[T, H, D]`` (the new tokens of B requests, request after
    request): request b's tokens are rows ``[qstart[b], qstart[b] + ext[b])`` at absolute positions
    ``pos0[b] + i``, and each attends to its request's keys ``[max(0, p - window + 1), p]`` (all of
    ``[0, p]`` without a window) read through ``table`` row b from ``layer`` of the pool, where they
    already are (the step stored them). ``qstart``/``pos0``/``ext`` int64 ``[B]``, ``table`` int64
    ``[B, W]`` with in-range pages. Returns ``[T, H, D]`` float32. Caller guarantees
    ``supports(pool_buffer)`` and ``extend_supported`` for the shape. ``dot``: a bfloat16 pool takes
    its products in bfloat16 where ``extend_dot_available()`` (Q and the softmax weights rounded to
    bfloat16 once each, sums float32: ~1e-3 relative from the float32-math path; 2-3x faster).
    ``softcap``: scores soft-capped before the mask, as :func:`paged_decode`."""
    T, H, D = q.shape
    q = q.float().contiguous()
    out = torch.empty_like(q)  # every row is written, or the call raises
    pool = _PoolView.of(pool_buffer, layer)
    rc = load().pdserve_paged_extend(
        q.data_ptr(),
        pool.base,
        pool.bf16,
        table.data_ptr(),
        table.stride(0),
        qstart.data_ptr(),
        pos0.data_ptr(),
        ext.data_ptr(),
        out.data_ptr(),
        ext.shape[0],
        H,
        pool.kv_heads,
        D,
        *pool.geometry,
        int(window or 0),
        float(scale),
        int(threads),
        int(dot and D <= EXTEND_DOT_MAX_DIM),
        float(softcap or 0.0),
    )
    if rc != 0:
        raise MemoryError("paged_extend: scratch allocation failed or the shape is not supported")
    return out
