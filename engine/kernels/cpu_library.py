"""The C CPU kernel library: its sources, how it is built and loaded, and its entry points' ctypes
signatures. The Python wrappers that call it are ``engine.kernels.cpu_native`` (attention and
matmuls) and ``engine.kernels.fused`` (per-layer ops); ``engine.decode_stack`` drives the
whole-step kernel.

Sources, compiled together into one library, ``pdserve_cpu_kernels-<hash>.so``:

- ``cpu_decode_attention.c``: paged decode attention, one query token per request against its keys
  read in place from the paged KV pool (``pdserve_paged_decode``).
- ``cpu_extend_attention.c``: paged prefill (extend) attention, tiled, causal and optionally
  windowed, over keys read in place (``pdserve_paged_extend``).
- ``cpu_fused.c``: the fused per-layer ops: RMSNorm (with the residual add; with a float32 weight),
  rotary, SiLU- and GELU-tanh-and-multiply, KV store (``pdserve_rms_norm``, ``pdserve_add_rms_norm``,
  ``pdserve_rms_norm_f32w``, ``pdserve_rope``, ``pdserve_silu_mul``, ``pdserve_gelu_tanh_mul``,
  ``pdserve_store_kv``).
- ``cpu_gemv.c``: ``x @ W.T`` for 1-8 bfloat16 rows against a plain bfloat16 or weight-only int8
  weight (``pdserve_gemv_bf16``, ``pdserve_gemv_i8w``; AVX512-BF16).
- ``cpu_gemm_pairs.c``: ``x @ W.T`` against a weight in the pair-panel layout, bfloat16 or int8
  (``pdserve_gemm_pairs_*``; AVX512-BF16), and against float32 panels (``pdserve_gemm_panels_f32``;
  AVX-512F).
- ``cpu_decode_stack.c``: a small decode step's transformer layers in one call, running the kernels
  above in the order the Python model does (``pdserve_decode_stack``).
- ``cpu_moe.c``: one mixture-of-experts layer's chosen experts for a step's tokens grouped by
  expert, each expert's weights read once (``pdserve_moe_experts``; float32, bfloat16, int8).
- ``cpu_moe_gemm.c``: the same for large steps, each expert's tokens register-blocked against its
  weights in the pair-panel layout (``pdserve_moe_gemm``; bfloat16, int8; AVX512-BF16).
- ``cpu_vec.h`` (included, not compiled): the vector helpers the sources share.

A kernel whose instructions the CPU lacks is still compiled; its ``*_available()`` entry point
returns 0 and the callers keep another path.

Build: ``cc -O3 -march=native -fopenmp -shared``, linked to ``libgomp.so.1``: loaded after torch,
that soname resolves to the runtime torch already mapped, so the kernels' parallel regions run on
torch's own warm OpenMP workers (a second pool, or threads started per call, would fight torch's
spinning workers for the cores). ``openmp_shared()`` checks that one OpenMP runtime is mapped; where
it is not, every call gets one thread. The library goes into ``$PDSERVE_KERNEL_CACHE`` (default
``~/.cache/pdserve/kernels``) under a name hashed from the sources, the flags and the CPU's flags,
written to a temporary file and renamed, so workers starting together never load a half-written
library. ``load()`` returns None when there is no compiler or the build fails (logged once): the
callers then keep the torch path. ``PDSERVE_NATIVE_KERNELS=0`` disables the kernels.
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
from pathlib import Path

from engine.cpu_features import cpu_flags

log = logging.getLogger(__name__)

LIBRARY_NAME = "pdserve_cpu_kernels"
SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_decode_attention.c",
        "cpu_extend_attention.c",
        "cpu_fused.c",
        "cpu_gemv.c",
        "cpu_gemm_pairs.c",
        "cpu_decode_stack.c",
        "cpu_moe.c",
        "cpu_moe_gemm.c",
    )
)
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)  # hashed with the sources; included, not compiled
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_I64, _PTR, _I32, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")


def library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` from the current sources for this CPU lives."""
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    key.update(" ".join((compiler, *CFLAGS, platform.machine(), *sorted(cpu_flags()))).encode())
    return cache_dir() / f"{LIBRARY_NAME}-{key.hexdigest()[:16]}.so"


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


def _compiler() -> str | None:
    """The C compiler to build with, or None where the kernels are disabled or none is installed."""
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc/gcc): the CPU kernels stay on the torch path")
    return compiler


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it cannot be had."""
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        path = library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the CPU kernels (%s): they stay on the torch path", detail)
        return None
    _declare_attention(lib)
    _declare_matmuls(lib)
    _declare_fused(lib)
    return lib


def _declare(lib: ctypes.CDLL, signatures: dict[str, tuple[list, type | None]]) -> None:
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def _declare_attention(lib: ctypes.CDLL) -> None:
    """``cpu_decode_attention.c`` and ``cpu_extend_attention.c``: (q, pool base, bf16, table, table
    stride, per-request ranges..., out, shape and strides, [window,] scale, threads, ..., softcap)."""
    head = [_PTR, _PTR, _I32, _PTR, _I64]
    _declare(
        lib,
        {
            "pdserve_paged_decode": ([*head, _PTR, _PTR, _PTR, *([_I64] * 9), _F32, _I32, _I32, _I32, _F32], _I32),
            "pdserve_paged_extend": ([*head, _PTR, _PTR, _PTR, _PTR, *([_I64] * 10), _F32, _I32, _I32, _F32], _I32),
            "pdserve_decode_dot_available": ([], _I32),
            "pdserve_extend_dot_available": ([], _I32),
        },
    )


def _declare_matmuls(lib: ctypes.CDLL) -> None:
    """``cpu_gemv.c`` and ``cpu_gemm_pairs.c`` (x, x stride, weight, [scale,] bias, y, rows, in, out,
    threads[, prefetch]), ``cpu_decode_stack.c`` (its argument struct, the hidden rows) and ``cpu_moe.c``
    (x, x stride, experts' weights, kind, grouping, scratch, out, sizes, threads)."""
    _declare(
        lib,
        {
            "pdserve_gemv_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32, _I32], _I32),
            "pdserve_gemv_i8w": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32, _I32], _I32),
            "pdserve_gemv_bf16_available": ([], _I32),
            "pdserve_gemm_pairs_bf16": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32], _I32),
            "pdserve_gemm_pairs_i8w": ([_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32], _I32),
            "pdserve_gemm_pairs_available": ([], _I32),
            "pdserve_gemm_panels_f32": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32], _I32),
            "pdserve_gemm_panels_f32_available": ([], _I32),
            "pdserve_decode_stack": ([_PTR, _PTR], _I32),
            "pdserve_moe_experts": ([_PTR, _I64, _PTR, _PTR, _I32, *([_PTR] * 8), *([_I64] * 3), _I32], _I32),
            "pdserve_moe_dot_available": ([], _I32),
            "pdserve_moe_gemm": ([_PTR, _I64, _PTR, _PTR, _I32, *([_PTR] * 8), *([_I64] * 3), _I32], _I32),
            "pdserve_moe_gemm_available": ([], _I32),
        },
    )


def _declare_fused(lib: ctypes.CDLL) -> None:
    """``cpu_fused.c``'s entry points (wrapped by ``engine.kernels.fused``); they return nothing."""
    _declare(
        lib,
        {
            "pdserve_rms_norm": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I32, _I32], None),
            "pdserve_rms_norm_f32w": ([_PTR, _I64, _PTR, _PTR, _I64, _I64, _F32, _I32, _I32], None),
            "pdserve_add_rms_norm": ([_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _I32, _I32], None),
            "pdserve_rope": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I32, _I32], None),
            "pdserve_silu_mul": ([_PTR, _PTR, _I64, _I64, _I32, _I32], None),
            "pdserve_gelu_tanh_mul": ([_PTR, _PTR, _I64, _I64, _I32, _I32], None),
            "pdserve_store_kv": ([_PTR, *([_I64] * 4), _PTR, _PTR, _I64, _PTR, *([_I64] * 4)], None),
        },
    )


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
