"""What the host CPU can do fast, for dtype choices on the CPU fallback path.

bf16 matmuls run at speed on x86 CPUs only with native bf16 instructions (AVX512_BF16 or AMX);
without them torch converts inside every op and bf16 runs slower than fp32 (as it does on
AVX2-only machines). ``cpu_flags`` reads ``/proc/cpuinfo`` (Linux); elsewhere it returns an empty
set and bf16 is trusted as is.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first CPU in ``/proc/cpuinfo`` (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool | None:
    """True/False on x86 Linux (native bf16 instructions or not); None when unknown."""
    flags = cpu_flags() if flags is None else flags
    if not flags or "avx2" not in flags and "avx" not in flags:
        return None  # not x86 (or unreadable): no opinion
    return any(f in flags for f in BF16_FLAGS)
