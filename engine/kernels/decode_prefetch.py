"""How the memory-streaming CPU kernels of a decode step prefetch on this machine, timed once per process.

Decode attention (``cpu_decode_attention.c``) and the small-batch bfloat16 matmul (``cpu_gemv.c``)
stream KV and weights from memory and prefetch ahead of their loads, either into L1
(``PREFETCH_L1``) or into L2 (``PREFETCH_L2``), each kernel at its own distances. Which is faster
depends on the CPU, by a lot: on some cores L1 prefetches are much the faster and L2 ones slow the
kernels down, on others L1 prefetches gain nothing and L2 ones up to ~2x. ``modes()`` times both modes of each
kernel on data twice the last-level cache (the attention on scattered pages, as a serving step reads
them) and keeps the faster per kernel for the process (logged). ``PDSERVE_DECODE_PREFETCH=l1|l2``
sets both instead, with no timing. The choice never changes an output, only the time to it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kernels import cpu_native
from engine.kernels.cpu_native import PREFETCH_L1, PREFETCH_L2

log = logging.getLogger(__name__)

ENV = "PDSERVE_DECODE_PREFETCH"
MODES = {"l1": PREFETCH_L1, "l2": PREFETCH_L2}
# the attention probe's step: 32 requests of 256 positions, SmolLM2's heads (9 query, 3 kv, 64 dims), 16-token pages
_BATCH, _CONTEXT, _HEADS, _KV_HEADS, _DIM, _PAGE = 32, 256, 9, 3, 64, 16
_WEIGHT = (3072, 576)  # the matmul probe's weight shape (SmolLM2's gate/up projection)
_MIN_BYTES, _MAX_BYTES = 64 << 20, 256 << 20


@dataclass(frozen=True)
class Modes:
    """The prefetch mode (``PREFETCH_L1`` / ``PREFETCH_L2``) of each kernel."""

    attention: int
    gemv: int


def last_level_cache_bytes(cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """Size of cpu0's highest-level cache from sysfs, or None where it cannot be read."""
    best: tuple[int, int] | None = None
    for index in cpu.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if scale != 1 else size
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return best[1] if best else None


def probe_bytes(llc: int | None) -> int:
    """Bytes each probe reads per pass: twice the last-level cache, within 64-256 MiB."""
    return min(_MAX_BYTES, max(_MIN_BYTES, 2 * (llc or 0)))


def best_of(runs: dict, rounds: int) -> dict:
    """Best seconds of each ``runs[key]()``, the runs alternating ``rounds`` times so a drifting
    machine's drift hits them alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for key, run in runs.items():
            t = time.perf_counter()
            run()
            best[key] = min(best[key], time.perf_counter() - t)
    return best


def time_attention(nbytes: int, rounds: int = 3) -> dict[int, float]:
    """Seconds per mode of decode attention over ``nbytes`` of bfloat16 KV, layer after layer."""
    from cache.pool_memory import zeroed

    per_layer = _BATCH * _CONTEXT * _KV_HEADS * _DIM * 2 * 2  # K and V, bfloat16
    layers = max(2, nbytes // per_layer)
    pages_each = _CONTEXT // _PAGE
    pool = zeroed((_BATCH * pages_each, layers, 2, _PAGE, _KV_HEADS, _DIM), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(pool.shape[0], generator=gen).view(_BATCH, pages_each).contiguous()
    lo, hi = torch.zeros(_BATCH, dtype=torch.int64), torch.full((_BATCH,), _CONTEXT, dtype=torch.int64)
    q = torch.ones(_BATCH, _HEADS, _DIM)
    threads = cpu_native.threads_for(_BATCH * _CONTEXT, _HEADS, _DIM, torch.get_num_threads())

    def run(mode: int) -> None:
        for layer in range(layers):
            cpu_native.paged_decode(q, pool, layer, table, lo, hi, 0.125, threads, prefetch=mode)

    return best_of({m: functools.partial(run, m) for m in MODES.values()}, rounds)


def probe_weights(nbytes: int) -> list[torch.Tensor]:
    """Zero bfloat16 weights of the probe's shape, ``nbytes`` of them (at least two)."""
    out, inp = _WEIGHT
    return [torch.zeros(out, inp, dtype=torch.bfloat16) for _ in range(max(2, nbytes // (out * inp * 2)))]


def time_gemv(nbytes: int, rounds: int = 3) -> dict[int, float]:
    """Seconds per mode of one-row bfloat16 matmuls over ``nbytes`` of weights."""
    weights = probe_weights(nbytes)
    x = torch.zeros(1, weights[0].shape[1], dtype=torch.bfloat16)

    def run(mode: int) -> None:
        for w in weights:
            cpu_native.gemv_bf16(x, w, None, prefetch=mode)

    return best_of({m: functools.partial(run, m) for m in MODES.values()}, rounds)


def _faster(kernel: str, times: dict[int, float], nbytes: int) -> int:
    chosen = min(times, key=times.get)
    names = {v: k for k, v in MODES.items()}
    log.info(
        "%s prefetch: %s (%s over %d MiB)",
        kernel,
        names[chosen],
        ", ".join(f"{names[m]} {s * 1e3:.1f} ms" for m, s in times.items()),
        nbytes >> 20,
    )
    return chosen


def forced_mode() -> int | None:
    """The mode ``PDSERVE_DECODE_PREFETCH`` forces on both kernels, None if unset; ``ValueError``
    if it names no mode."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in MODES:
        raise ValueError(f"{ENV}={forced!r}: choose one of {', '.join(MODES)}")
    return MODES[forced] if forced else None


@functools.lru_cache(maxsize=1)
def modes() -> Modes:
    """This process's modes: both ``PDSERVE_DECODE_PREFETCH`` if set (``ValueError`` if it names no
    mode), else each kernel's faster on this machine (timed on first call, ~0.1-0.3 s), else
    ``PREFETCH_L1`` where a kernel is not built."""
    forced = forced_mode()
    if forced is not None:
        return Modes(forced, forced)
    if cpu_native.load() is None:
        return Modes(PREFETCH_L1, PREFETCH_L1)
    nbytes = probe_bytes(last_level_cache_bytes())
    attention = _faster("decode attention", time_attention(nbytes), nbytes)
    gemv = _faster("small-batch matmul", time_gemv(nbytes), nbytes) if cpu_native.gemv_available() else PREFETCH_L1
    return Modes(attention, gemv)
