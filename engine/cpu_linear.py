"""``x @ W.T`` with the weight prepared once for the device: each CPU weight is kept in the layout of
the kernel that serves it, chosen once at load time by ``pack``.

Layouts, by weight and machine:

- oneDNN's blocked layout (``onednn_layout``; ``mkldnn._reorder_linear_weight``, as torch's inductor
  does for frozen CPU linears) for float32 weights, and bfloat16 ones where the CPU has native
  bfloat16 instructions. torch's ``F.linear`` on CPU float32 goes to MKL sgemm with the plain
  ``[out, in]`` weight, a fraction of the core's speed at a decode step's 1-64 rows.
- Plain ``[out, in]`` for ``cpu_gemv.c`` beside oneDNN's copy, for a bfloat16 weight of at most
  ``GEMV_MAX_BYTES`` on AVX512-BF16: calls of up to ``gemv_rows()`` rows go there, since oneDNN's
  fixed per-call cost is most of a small matmul's time.
- Pair panels (``to_pairs``, ``cpu_gemm_pairs.c``) where ``out % 64 == 0``: no per-output
  horizontal sums, so they serve 16-64-row decode steps too. Where ``pairs_take_all()``
  (AVX512-BF16 without AMX) a bfloat16 weight of that shape, any size, is held ONLY as pairs and
  every call runs the kernel, prompts too; else calls of up to ``pairs_rows()`` rows (timed once per
  process against oneDNN) take it, longer ones oneDNN.
- Float32 panels (``to_panels_f32``) only, for a float32 weight with ``out % 64 == 0`` and at most
  ``GEMV_MAX_BYTES`` (the LM head keeps oneDNN's): every call runs that kernel.
- Weight-only int8 (``pack(w, int8=True)``, ``--weight-dtype int8``): each output row becomes int8
  values ``q`` and one float32 scale (symmetric, ``max |w_row| / 127``). Calls of up to
  ``GEMV_MAX_ROWS`` rows run the int8 kernel on ``q`` itself (half the bytes of bfloat16); longer
  calls run oneDNN on ``q * scale`` rounded to bfloat16, the same weights up to bfloat16's rounding.

Panels replace oneDNN's copy rather than add to it, so a weight's bytes are held once, and the
decode stack (``engine.decode_stack``) runs the same kernels. ``pdserve bench engine --roofline``
and ``benchmarks/gemm_rows.py`` time each path on the machine.

Why rows are bucketed: oneDNN builds (JIT-compiles) one primitive per input shape and keeps it, and
no cache setting bounds that (``LRU_CACHE_CAPACITY`` and ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` do
not), so raw row counts grow a process without bound. Inputs are zero-padded up to the next of
``ROW_BUCKETS``, longer ones run in ``CHUNK_ROWS`` pieces: at most ``len(ROW_BUCKETS)`` shapes per
weight, ever.

Contract: ``pack(w)`` returns what ``linear(x, packed, bias)`` takes; ``linear`` of a plain tensor
is ``F.linear``. Packing happens only for 2-D float32 CPU weights when this torch has oneDNN, bfloat16
ones where ``has_fast_bf16()``; anything else (CUDA, float16, no oneDNN) stays a plain tensor.
Results equal ``F.linear`''s up to float32 rounding (bfloat16's for bfloat16 and int8 weights). A
row's result never depends on the other rows of its call (padding rows are zeros and are dropped).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cpu_features import cpu_flags, has_fast_bf16
from engine.kernels import cpu_native, decode_prefetch
from engine.weight_layout import Int8Rows, pairs_shape, quantize_int8, to_pairs, to_panels_f32

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 32  # row count oneDNN picks the blocked layout for (any count works)
CHUNK_ROWS = 512
# decode-sized counts finely (padding there is not free: 64 rows is already compute-bound), then
# coarser up to one chunk; every call runs at one of these row counts
ROW_BUCKETS = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    40,
    48,
    56,
    64,
    80,
    96,
    112,
    128,
    160,
    192,
    224,
    256,
    288,
    320,
    352,
    384,
    416,
    448,
    480,
    CHUNK_ROWS,
)  # steps of 32 above 128: a prompt pads at most 31 rows (64 wasted ~12%)


# A bfloat16 weight up to this size also keeps its plain layout for ``cpu_gemv.c`` (oneDNN's per-call
# cost is most of a small call); larger ones (the LM head) run at bandwidth in oneDNN too.
GEMV_MAX_BYTES = 16 << 20
GEMV_ALIGN_IN, GEMV_ALIGN_OUT = 32, 8  # the kernel's chunk of inputs and largest block of outputs
# Calls of up to ``gemv_rows()`` rows take the kernel: GEMV_ROWS by default (the kernel's lead,
# oneDNN's fixed per-call cost, shrinks as rows add work and is gone by 8 on some machines), all it can take (8) where
# the process's probe finds it faster than oneDNN at 8 rows.
GEMV_ROWS = 4


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out, in]`` weight in oneDNN's layout, or only in panels (``onednn`` False); ``shape`` is the
    original one. ``plain`` is the original contiguous weight where the small-batch bfloat16 kernel
    serves calls of up to ``gemv_rows()`` rows (it costs the weight's bytes once more), else None.
    ``int8``: the weight is weight-only int8 (``data`` then holds its dequantized bfloat16 values),
    and calls of up to ``GEMV_MAX_ROWS`` rows go to the int8 kernel."""

    data: torch.Tensor
    shape: torch.Size
    plain: torch.Tensor | None = None
    int8: Int8Rows | None = None
    pairs: torch.Tensor | None = None  # bfloat16 pair panels, or float32 panels (``to_panels_f32``)
    onednn: bool = True  # False: kept only as (pair) panels (``data`` is ``pairs``), every call their kernel


def onednn_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` reordered into oneDNN's packed layout, what its linear primitive reads (``pack`` may keep
    a weight as panels instead; probes and benches that time oneDNN take this)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)


def packing_enabled(w: torch.Tensor) -> bool:
    """True iff ``w`` is a weight ``pack`` would reorder on this machine."""
    if w.device.type != "cpu" or w.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and has_fast_bf16() is True)


def int8_supported(w: torch.Tensor) -> str | None:
    """None iff ``pack(w, int8=True)`` can serve ``w`` as weight-only int8 here, else why not (for
    the error a user sees): a 2-D bfloat16 CPU weight with oneDNN, on a CPU with AVX512-BF16 (the
    kernel widens int8 to bfloat16 in registers), shaped for the kernel."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16:
        return f"int8 weights run on CPU with bfloat16 activations (this weight is {w.dtype} on {w.device.type})"
    if not packing_enabled(w) or not cpu_native.gemv_available():
        return "int8 weights need a CPU with AVX512-BF16, a C compiler and torch with oneDNN"
    if not _kernel_shape(w):
        out, inp = w.shape
        return (
            f"a [{out}, {inp}] weight: the int8 kernel needs in % {GEMV_ALIGN_IN} == 0 and out % {GEMV_ALIGN_OUT} == 0"
        )
    return None


def _kernel_shape(w: torch.Tensor) -> bool:
    """True iff ``cpu_gemv.c`` can block ``w``'s ``[out, in]`` (either of its kernels)."""
    out, inp = w.shape
    return inp % GEMV_ALIGN_IN == 0 and out % GEMV_ALIGN_OUT == 0


def pack(w: torch.Tensor, int8: bool = False) -> torch.Tensor | PackedWeight:
    """``w`` prepared for ``linear`` (reordered for oneDNN where that pays, else ``w`` itself).
    ``int8``: quantize it to weight-only int8 (``quantize_int8``); ``ValueError`` where
    ``int8_supported`` says it cannot be served so."""
    if int8:
        why = int8_supported(w)
        if why is not None:
            raise ValueError(why)
        rows = quantize_int8(w)
        deq = rows.dequantize(w.dtype).contiguous()
        return PackedWeight(onednn_layout(deq), w.shape, None, rows)
    if not packing_enabled(w):
        return w
    if w.dtype == torch.float32 and _panels_f32_takes(w):
        panels = to_panels_f32(w)
        return PackedWeight(panels, w.shape, pairs=panels, onednn=False)
    pairs_ok = w.dtype == torch.bfloat16 and pairs_shape(w) and cpu_native.pairs_available()
    if pairs_ok and pairs_take_all():  # any size: the LM head too
        pairs = to_pairs(w)
        return PackedWeight(pairs, w.shape, pairs=pairs, onednn=False)
    small = _gemv_takes(w)
    pairs = to_pairs(w) if small and pairs_ok else None
    plain = w.contiguous() if small and pairs is None else None
    return PackedWeight(onednn_layout(w), w.shape, plain, None, pairs)


def _gemv_takes(w: torch.Tensor) -> bool:
    """True iff calls of few rows on ``w`` go to ``cpu_gemv.c``: a bfloat16 weight of at most
    GEMV_MAX_BYTES whose shape fits the kernel, on a CPU where it was built with AVX512-BF16."""
    return (
        w.dtype == torch.bfloat16
        and w.numel() * w.element_size() <= GEMV_MAX_BYTES
        and _kernel_shape(w)
        and cpu_native.gemv_available()
    )


def _panels_f32_takes(w: torch.Tensor) -> bool:
    """True iff a float32 weight is kept as float32 panels instead of oneDNN's layout: out % 64 == 0,
    at most GEMV_MAX_BYTES (the LM head stays oneDNN's), the kernel built here (AVX-512F)."""
    return (
        w.shape[0] % cpu_native.PAIRS_PANEL == 0
        and w.numel() * w.element_size() <= GEMV_MAX_BYTES
        and cpu_native.panels_f32_available()
    )


def bucket_rows(rows: int) -> int:
    """The row count a call of ``rows`` (1..CHUNK_ROWS) runs at: the smallest bucket that holds it."""
    return ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)]


def _packed_rows(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN call on 2-D ``x`` of at most CHUNK_ROWS rows, padded to its bucket."""
    rows = x.shape[0]
    pad = bucket_rows(rows) - rows
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    y = torch.ops.mkldnn._linear_pointwise(x, w.data, bias, "none", [], "")
    return y[:rows] if pad else y


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` over the last dimension of ``x``."""
    if not isinstance(w, PackedWeight):
        return F.linear(x, w, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], w.shape[0])
    if not w.onednn:
        return _panels(x2, w, bias).view(*x.shape[:-1], w.shape[0])
    if w.int8 is not None or w.plain is not None or w.pairs is not None:  # large weights skip the call
        y = _small_rows(x2, w, bias)
        if y is not None:
            return y.view(*x.shape[:-1], w.shape[0])
    if x2.shape[0] <= CHUNK_ROWS:
        y = _packed_rows(x2.contiguous(), w, bias)
    else:
        y = torch.cat([_packed_rows(c.contiguous(), w, bias) for c in x2.split(CHUNK_ROWS)])
    return y.view(*x.shape[:-1], w.shape[0])


def _panels(x2: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """A panels-only weight's call, any rows: float32 panels or bfloat16 pairs on rows of the weight's
    dtype with a contiguous last dimension (other inputs are made so first; a bias the kernel cannot
    take is added after)."""
    dt = w.pairs.dtype
    if x2.dtype != dt or x2.stride(-1) != 1:
        x2 = x2.to(dt).contiguous()
    fused = bias is None or (bias.dtype == dt and bias.is_contiguous())
    kernel = cpu_native.gemm_panels_f32 if dt == torch.float32 else cpu_native.gemm_pairs
    y = kernel(x2, w.pairs, w.shape[0], bias if fused else None)
    if y is None:
        raise RuntimeError(f"panel kernel refused a [{x2.shape[0]}, {x2.shape[1]}] input for {tuple(w.shape)}")
    return y if fused else y + bias


def _small_rows(x2: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The small-batch kernel's result where it takes this call (int8 or plain bfloat16 weight, few
    bfloat16 rows, contiguous last dim, bfloat16 bias), else None. (panels-only weights: ``_panels``.)"""
    if (
        x2.dtype != torch.bfloat16
        or x2.stride(-1) != 1
        or not (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    ):
        return None
    kernel = small_kernel(w)
    if kernel is None or x2.shape[0] > small_rows(w):
        return None
    kind, weight, scale = kernel
    if kind in (PAIRS_BF16, PAIRS_I8):
        return cpu_native.gemm_pairs(x2, weight, w.shape[0], bias, scale)
    prefetch = decode_prefetch.modes().gemv
    if kind == GEMV_I8:
        return cpu_native.gemv_i8w(x2, weight, scale, bias, prefetch)
    return cpu_native.gemv_bf16(x2, weight, bias, prefetch)


# The small-batch kernels a weight can be stored for (``small_kernel``); the numbers are
# ``cpu_decode_stack.c``'s matmul kinds.
GEMV_BF16, GEMV_I8, PAIRS_BF16, PAIRS_I8, PANELS_F32 = range(5)
PANELS_ROWS = CHUNK_ROWS  # panels-only weights serve every call (module docstring); the decode stack's limit


def small_kernel(w) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
    """``(kind, weight as that kernel reads it, float32 row scales or None)`` of the small-batch
    kernel that serves ``w``'s calls of up to ``small_rows(w)`` rows; None where none does. The
    one routing rule: (pair) panels where ``w`` has them, else ``cpu_gemv.c``."""
    if not isinstance(w, PackedWeight):
        return None
    if w.pairs is not None:
        return (PANELS_F32 if w.pairs.dtype == torch.float32 else PAIRS_BF16), w.pairs, None
    if w.int8 is not None:
        if w.int8.pairs is not None:
            return PAIRS_I8, w.int8.pairs, w.int8.scale
        return GEMV_I8, w.int8.q, w.int8.scale
    return (GEMV_BF16, w.plain, None) if w.plain is not None else None


def small_rows(w) -> int:
    """The most rows of a call on ``w`` that its small-batch kernel takes (0: none): ``PANELS_ROWS`` for a
    panels-only weight, ``pairs_rows()`` for another pair-panel one, else ``GEMV_MAX_ROWS`` (int8) or
    ``gemv_rows()`` (plain bfloat16)."""
    kernel = small_kernel(w)
    if kernel is None:
        return 0
    if not w.onednn:
        return PANELS_ROWS
    if kernel[0] in (PAIRS_BF16, PAIRS_I8):
        return pairs_rows()
    return cpu_native.GEMV_MAX_ROWS if kernel[0] == GEMV_I8 else gemv_rows()


# Row counts the pair-panel kernel is timed at against oneDNN (largest first; calls of up to the
# largest it wins take it). PAIRS_ROWS where untimed; PAIRS_MIN_ROWS where it wins none (at 1-4 rows
# it reads the weight once at bandwidth, where oneDNN's per-call cost is most of the call).
PAIRS_PROBE_ROWS = (64, 32, 16, 8)
PAIRS_ROWS, PAIRS_MIN_ROWS = 32, 4
# A decoder layer's matmul shapes ([out, in]: QKV, O, gate/up, down of a 576-wide model): the mix a
# decode step runs, where oneDNN's efficiency differs by shape.
_PROBE_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _layer_probe(nbytes: int) -> list[torch.Tensor]:
    """Zero bfloat16 weights of ``_PROBE_LAYER``'s shapes, layer after layer, ``nbytes`` in all."""
    layer = sum(o * i * 2 for o, i in _PROBE_LAYER)
    return [torch.zeros(o, i, dtype=torch.bfloat16) for _ in range(max(1, nbytes // layer)) for o, i in _PROBE_LAYER]


@functools.lru_cache(maxsize=1)
def pairs_rows() -> int:
    """The most rows a call may have to take the pair-panel kernel (``cpu_gemm_pairs.c``), timed once
    per process against oneDNN's packed primitive over weights twice the last-level cache (~0.1 s),
    so the weights stream from memory as in a served decode step."""
    if not cpu_native.pairs_available() or not packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        return PAIRS_MIN_ROWS
    if decode_prefetch.forced_mode() is not None:
        return PAIRS_ROWS
    weights = _layer_probe(decode_prefetch.probe_bytes(decode_prefetch.last_level_cache_bytes()))
    pairs = [to_pairs(w) for w in weights]
    packed = [onednn_layout(w) for w in weights]
    for rows in PAIRS_PROBE_ROWS:
        xs = {k: torch.zeros(rows, k, dtype=torch.bfloat16) for k in {w.shape[1] for w in weights}}
        best = decode_prefetch.best_of(
            {
                "pairs": lambda xs=xs: [
                    cpu_native.gemm_pairs(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, pairs)
                ],
                "onednn": lambda xs=xs: [
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], d, None, "none", [], "")
                    for w, d in zip(weights, packed)
                ],
            },
            3,
        )
        log.info(
            "pair-panel matmul at %d rows: %.1f ms, oneDNN %.1f ms", rows, best["pairs"] * 1e3, best["onednn"] * 1e3
        )
        if best["pairs"] < best["onednn"]:
            return rows
    return PAIRS_MIN_ROWS


@functools.lru_cache(maxsize=1)
def pairs_take_all() -> bool:
    """True iff a bfloat16 weight with pair panels is held only as them, every call (prompts too) the
    pair kernel: where it is built and the CPU has no AMX (oneDNN's tiles run prompts several times
    faster there), unless ``PDSERVE_PAIRS_ALL=0``. A fixed rule, not a timing, so every process of a
    cluster on this machine computes a prompt the same way."""
    return (
        os.environ.get("PDSERVE_PAIRS_ALL", "1") != "0"
        and cpu_native.pairs_available()
        and "amx_bf16" not in cpu_flags()
    )


@functools.lru_cache(maxsize=1)
def gemv_rows() -> int:
    """The most rows a bfloat16 call may have to take the small-batch kernel: GEMV_ROWS, or
    ``cpu_native.GEMV_MAX_ROWS`` where the kernel (in this process's prefetch mode) beats oneDNN's
    packed primitive at that many rows over weights twice the last-level cache (timed once, ~50 ms).
    GEMV_ROWS without
    timing where the kernel or packing is missing or ``PDSERVE_DECODE_PREFETCH`` is set."""
    if (
        not cpu_native.gemv_available()
        or not packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16))
        or decode_prefetch.forced_mode() is not None
    ):
        return GEMV_ROWS
    kernel, onednn = time_against_onednn(
        decode_prefetch.probe_bytes(decode_prefetch.last_level_cache_bytes()), decode_prefetch.modes().gemv
    )
    rows = cpu_native.GEMV_MAX_ROWS if kernel < onednn else GEMV_ROWS
    log.info(
        "small-batch matmul takes up to %d rows (%d rows: kernel %.1f ms, oneDNN %.1f ms)",
        rows,
        cpu_native.GEMV_MAX_ROWS,
        kernel * 1e3,
        onednn * 1e3,
    )
    return rows


def time_against_onednn(nbytes: int, prefetch: int, rounds: int = 3) -> tuple[float, float]:
    """(kernel, oneDNN) best seconds of ``GEMV_MAX_ROWS``-row bfloat16 matmuls over ``nbytes`` of
    probe weights, the kernel in mode ``prefetch``, oneDNN on them in its packed layout (not ``pack``'s
    choice: that may be pair panels, which oneDNN cannot read)."""
    weights = decode_prefetch.probe_weights(nbytes)
    packed = [PackedWeight(onednn_layout(w), w.shape) for w in weights]
    x = torch.zeros(cpu_native.GEMV_MAX_ROWS, weights[0].shape[1], dtype=torch.bfloat16)
    best = decode_prefetch.best_of(
        {
            "kernel": lambda: [cpu_native.gemv_bf16(x, w, None, prefetch) for w in weights],
            "onednn": lambda: [_packed_rows(x, p, None) for p in packed],
        },
        rounds,
    )
    return best["kernel"], best["onednn"]


def warm_up(
    pairs: Iterable[tuple[torch.Tensor | PackedWeight, torch.Tensor | None]], max_rows: int = CHUNK_ROWS
) -> int:
    """Run every ``(weight, bias)`` shape once at every row bucket up to ``max_rows``; returns the
    calls made.

    oneDNN builds a primitive the first time it sees a shape; doing that for all of them at load
    time means a served request never waits for a JIT compile and the process's memory is final
    before it serves (the soak's RSS-growth check measures exactly that). Plain weights and float32
    panels (no primitive) are skipped. The small-batch kernels' row limits (timed once per process)
    are settled here too, not at a served request's first matmul.
    """
    seen: set[tuple[torch.Size, bool]] = set()
    buckets = [r for r in ROW_BUCKETS if r <= max(max_rows, 1)]
    with torch.inference_mode():
        for w, bias in pairs:
            key = (w.shape, bias is not None) if isinstance(w, PackedWeight) and w.onednn else None
            if key is None or key in seen:
                continue
            seen.add(key)
            small_rows(w)  # the small-batch kernel's row limit: timed here, once per process
            if w.int8 is not None or w.plain is not None:
                decode_prefetch.modes()
            for rows in buckets:
                _packed_rows(torch.zeros(rows, w.shape[1], dtype=w.data.dtype), w, bias)
    return len(seen) * len(buckets)
