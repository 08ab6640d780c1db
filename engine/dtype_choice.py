"""Which compute dtype a worker runs in (``--dtype``), and why: the line the start-up log prints.

``auto`` on CUDA is bfloat16. On CPU it is bfloat16 where that is both fast and lossless for the
weights: the CPU has native bf16 instructions (AVX512-BF16 or AMX, ``engine.cpu_features``) and the
checkpoint stores its weights in bfloat16, so running in bfloat16 rounds none of them. Elsewhere it
is float32: a float32 checkpoint asked for float32; float16 weights do not fit bfloat16's 7-bit
mantissa; a quantized GGUF dequantizes to values bfloat16 cannot hold (scale x quant + min), so
bfloat16 would add a rounding to the quantization's; and without native bf16 every op converts and
bfloat16 runs slower than float32. ``--dtype float32`` is the exact mode the reference tests use.
"""

from __future__ import annotations

import logging

import torch

from engine.cpu_features import has_fast_bf16

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def choose_dtype(
    spec: str, device: torch.device, stored: str = "float32", flags: frozenset[str] | None = None
) -> tuple[torch.dtype, str]:
    """``(dtype, reason)`` for ``--dtype spec`` on ``device`` with weights stored as ``stored``
    (``float32``, ``bfloat16``, ``float16`` or ``quantized``); ``flags``: CPU flags (tests)."""
    fast = has_fast_bf16(flags)
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16, "auto on CUDA"
        if stored != "bfloat16":
            return torch.float32, f"auto on CPU with {stored} weights (bfloat16 would round them)"
        if fast is False:
            return torch.float32, "auto on a CPU without AVX512-BF16/AMX (bfloat16 would run slower)"
        return torch.bfloat16, "auto on CPU with bfloat16 weights and native bf16 instructions"
    if spec == "bfloat16" and device.type == "cpu" and fast is False:
        log.warning(
            "--dtype bfloat16 on a CPU without AVX512_BF16/AMX: every op would convert to fp32 and run "
            "slower than fp32; using float32 instead"
        )
        return torch.float32, "--dtype bfloat16 on a CPU without AVX512-BF16/AMX"
    return DTYPES[spec], f"--dtype {spec}"


def resolve_dtype(
    spec: str, device: torch.device, flags: frozenset[str] | None = None, stored: str = "float32"
) -> torch.dtype:
    """The dtype of :func:`choose_dtype`, without its reason."""
    return choose_dtype(spec, device, stored, flags)[0]
