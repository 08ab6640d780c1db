"""The C CPU kernels (``cpu_decode_attention.c``, and ``cpu_fused.c`` wrapped by ``engine.kernels.fused``):
compiled once per machine into one library, loaded with ctypes.

``paged_decode`` is the CPU decode attention of ``engine.attention.CpuBackend``: it reads each
request's keys in place from the paged pool, where the torch path gathers every request's pages
padded to the longest request and runs SDPA on the copy (at batch 32 and 300-token contexts that
path spent ~250 ms per step of SmolLM2 in attention, the kernel ~40 ms; ``pdserve bench engine``).
It reads float32 and bfloat16 pools (bfloat16 keys are widened as they are read; the query, the sums
and the output are float32).

Build: ``cc -O3 -march=native -fopenmp -shared``, linked to ``libgomp.so.1``: loaded after torch, that
soname resolves to the runtime torch already mapped, so the kernels' parallel regions run on torch's
own warm OpenMP workers (a second pool, or pthreads started per call, fought torch's spinning
workers for the cores: measured slower with two threads than with one). ``openmp_shared()`` checks
that one OpenMP runtime is mapped; where it is not, every call gets one thread. Into
``$PDSERVE_KERNEL_CACHE`` (default
``~/.cache/pdserve/kernels``) under a name hashed from the source, the flags and the CPU's flags;
written to a temporary file and renamed, so workers starting together never load a half-written
library. ``load()`` returns None when there is no compiler or the build fails (logged once): the
caller then keeps the torch path. ``PDSERVE_NATIVE_KERNELS=0`` disables the kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_decode_attention.c",
        "cpu_extend_attention.c",
        "cpu_fused.c",
        "cpu_gemv.c",
        "cpu_gemm_pairs.c",
        "cpu_decode_stack.c",
    )
)
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # hashed with the sources; included, not compiled
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
MAX_HEAD_DIM = 1024
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
DTYPES = (torch.float32, torch.bfloat16)


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    key.update(" ".join((compiler, *CFLAGS, platform.machine(), *sorted(cpu_flags()))).encode())
    return cache_dir() / f"cpu_decode_attention-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot be had."""
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc/gcc): CPU decode attention stays on the torch path")
        return None
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the CPU kernels (%s): CPU decode attention stays on the torch path", detail)
        return None
    fn = lib.pdserve_paged_decode
    fn.argtypes = [
        _PTR,
        _PTR,
        ctypes.c_int,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        *([_I64] * 9),
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_int
    lib.pdserve_decode_dot_available.restype = ctypes.c_int
    fn = lib.pdserve_paged_extend
    fn.argtypes = [
        _PTR,
        _PTR,
        ctypes.c_int,
        _PTR,
        _I64,
        _PTR,
        _PTR,
        _PTR,
        _PTR,
        *([_I64] * 10),
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_int
    lib.pdserve_extend_dot_available.restype = ctypes.c_int
    _declare_fused(lib)
    return lib


def _declare_fused(lib: ctypes.CDLL) -> None:
    """Argument types of ``cpu_fused.c``'s entry points (wrapped by ``engine.kernels.fused``)."""
    i32, f32 = ctypes.c_int, ctypes.c_float
    signatures = {
        "pdserve_rms_norm": [_PTR, _I64, _PTR, _PTR, _I64, _I64, f32, i32, i32],
        "pdserve_add_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, f32, i32, i32],
        "pdserve_rope": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32, i32],
        "pdserve_silu_mul": [_PTR, _PTR, _I64, _I64, i32, i32],
        "pdserve_store_kv": [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64],
    }
    lib.pdserve_gemv_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32, i32]
    lib.pdserve_gemv_bf16.restype = i32
    lib.pdserve_gemv_i8w.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32, i32]
    lib.pdserve_gemv_i8w.restype = i32
    lib.pdserve_gemv_bf16_available.argtypes, lib.pdserve_gemv_bf16_available.restype = [], i32
    lib.pdserve_decode_stack.argtypes, lib.pdserve_decode_stack.restype = [_PTR, _PTR], i32
    lib.pdserve_gemm_pairs_bf16.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32]
    lib.pdserve_gemm_pairs_bf16.restype = i32
    lib.pdserve_gemm_pairs_i8w.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32]
    lib.pdserve_gemm_pairs_i8w.restype = i32
    lib.pdserve_gemm_pairs_available.argtypes, lib.pdserve_gemm_pairs_available.restype = [], i32
    lib.pdserve_gemm_panels_f32.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, i32]
    lib.pdserve_gemm_panels_f32.restype = i32
    lib.pdserve_gemm_panels_f32_available.argtypes, lib.pdserve_gemm_panels_f32_available.restype = [], i32
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None


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
# one core's work on a batch read from memory (measured in a serving step, not from cache).
WORK_PER_THREAD = 1 << 17


@functools.lru_cache(maxsize=1)
def openmp_shared() -> bool:
    """True iff at most one OpenMP runtime (libgomp / libiomp) is mapped into this process after the
    kernels loaded, i.e. their parallel regions use torch's pool. False where it cannot be read."""
    if load() is None:
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}
    return len(paths) <= 1


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
) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, D]`` over keys ``[lo[b], hi[b])`` of request b in ``layer`` of
    the pool; ``table`` ``[B, W]`` int64 maps ``pos // P`` to a page (only entries of pages in the
    range are read); ``lo``/``hi`` int64 ``[B]``. Returns ``[B, H, D]`` float32 (zeros for an empty
    range). ``q`` may be any float dtype (it is read as float32). ``prefetch``: ``PREFETCH_L1`` or
    ``PREFETCH_L2`` (speed only). ``dot``: a bfloat16 pool takes its products in bfloat16 where
    ``decode_dot_available()`` (the query and the softmax weights rounded to bfloat16 once each, sums
    and softmax float32: ~2^-9 relative from the float32-math path, which a bfloat16 model's query
    loses nothing to; ~2x fewer instructions). Caller guarantees ``supports(pool_buffer)``,
    contiguous int64 indices and in-range pages."""
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
) -> torch.Tensor:
    """Prefill attention of ``q`` ``[T, H, D]`` (the new tokens of B requests, request after
    request): request b's tokens are rows ``[qstart[b], qstart[b] + ext[b])`` at absolute positions
    ``pos0[b] + i``, and each attends to its request's keys ``[max(0, p - window + 1), p]`` (all of
    ``[0, p]`` without a window) read through ``table`` row b from ``layer`` of the pool, where they
    already are (the step stored them). ``qstart``/``pos0``/``ext`` int64 ``[B]``, ``table`` int64
    ``[B, W]`` with in-range pages. Returns ``[T, H, D]`` float32. Caller guarantees
    ``supports(pool_buffer)`` and ``extend_supported`` for the shape. ``dot``: a bfloat16 pool takes
    its products in bfloat16 where ``extend_dot_available()`` (Q and the softmax weights rounded to
    bfloat16 once each, sums float32: ~1e-3 relative from the float32-math path; 2-3x faster)."""
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
    )
    if rc != 0:
        raise MemoryError("paged_extend: scratch allocation failed or the shape is not supported")
    return out
