"""Which row prefetch the CPU decode attention kernel uses on this machine, timed once per process.

``cpu_decode_attention.c`` prefetches the rows of the block after the one it computes either far
ahead into L1 (``PREFETCH_L1_FAR``) or near ahead into L2 (``PREFETCH_L2_NEAR``). Which one is
faster depends on the CPU, by a lot: on a 2-core Zen 5 L1 prefetches made the kernel 1.56x faster
and L2 ones were slower; on a 2-core Zen 4 L1 prefetches of any distance ran no faster than none,
and L2 ones made it 1.7-1.9x faster from DRAM. ``mode()`` times both on a pool larger than the
last-level cache (scattered pages, as a serving step reads them) and keeps the faster for the
process. ``PDSERVE_DECODE_PREFETCH=l1-far|l2-near`` sets it instead, with no timing. The choice
never changes an output, only the time to it.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

from engine.kernels import cpu_native
from engine.kernels.cpu_native import PREFETCH_L1_FAR, PREFETCH_L2_NEAR

log = logging.getLogger(__name__)

ENV = "PDSERVE_DECODE_PREFETCH"
MODES = {"l1-far": PREFETCH_L1_FAR, "l2-near": PREFETCH_L2_NEAR}
# the probe's step: 32 requests of 256 positions, SmolLM2's heads (9 query, 3 kv, 64 dims), 16-token pages
_BATCH, _CONTEXT, _HEADS, _KV_HEADS, _DIM, _PAGE = 32, 256, 9, 3, 64, 16
_MIN_BYTES, _MAX_BYTES = 64 << 20, 256 << 20


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
    """KV bytes the probe reads per pass: twice the last-level cache, within 64-256 MiB."""
    return min(_MAX_BYTES, max(_MIN_BYTES, 2 * (llc or 0)))


def time_modes(pool_bytes: int, rounds: int = 3) -> dict[int, float]:
    """Best seconds per mode (``PREFETCH_*``) of one pass of decode attention over ``pool_bytes`` of
    bfloat16 KV (layer after layer, each a batch's scattered pages), modes alternating for
    ``rounds`` rounds so drift hits both alike."""
    from cache.pool_memory import zeroed

    per_layer = _BATCH * _CONTEXT * _KV_HEADS * _DIM * 2 * 2  # K and V, bfloat16
    layers = max(2, pool_bytes // per_layer)
    pages_each = _CONTEXT // _PAGE
    pool = zeroed((_BATCH * pages_each, layers, 2, _PAGE, _KV_HEADS, _DIM), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(pool.shape[0], generator=gen).view(_BATCH, pages_each).contiguous()
    lo = torch.zeros(_BATCH, dtype=torch.int64)
    hi = torch.full((_BATCH,), _CONTEXT, dtype=torch.int64)
    q = torch.ones(_BATCH, _HEADS, _DIM)
    threads = cpu_native.threads_for(_BATCH * _CONTEXT, _HEADS, _DIM, torch.get_num_threads())
    best = dict.fromkeys(MODES.values(), float("inf"))
    for _ in range(rounds):
        for m in best:
            t = time.perf_counter()
            for layer in range(layers):
                cpu_native.paged_decode(q, pool, layer, table, lo, hi, 0.125, threads, prefetch=m)
            best[m] = min(best[m], time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=1)
def mode() -> int:
    """This process's prefetch mode: ``PDSERVE_DECODE_PREFETCH`` if set (``ValueError`` if it names
    no mode), else the faster of the two on this machine (timed on first call, ~0.1 s), else
    ``PREFETCH_L1_FAR`` where the kernels are not built."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"{ENV}={forced!r}: choose one of {', '.join(MODES)}")
        return MODES[forced]
    if cpu_native.load() is None:
        return PREFETCH_L1_FAR
    nbytes = probe_bytes(last_level_cache_bytes())
    times = time_modes(nbytes)
    chosen = min(times, key=times.get)
    names = {v: k for k, v in MODES.items()}
    log.info("decode attention prefetch: %s (%s over %d MiB of KV)", names[chosen],
             ", ".join(f"{names[m]} {s * 1e3:.1f} ms" for m, s in times.items()), nbytes >> 20)
    return chosen
