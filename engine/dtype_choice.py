"""Which compute dtype a worker runs in (``--dtype``), and why: the line the start-up log prints.

``auto`` on CUDA is bfloat16. On CPU it is bfloat16 where the CPU has native bf16 instructions
(AVX512-BF16 or AMX, ``engine.cpu_features``) and the checkpoint's weights are bfloat16 or a GGUF
quantization: bfloat16 weights lose nothing, and a quantized model's dequantized values (scale x
quant + min) gain one bfloat16 rounding on top of the quantization's own error, for about twice
the decode speed of float32 (a decode step reads half the bytes). Elsewhere it is float32: a float32
checkpoint asked for float32; float16 weights do not fit bfloat16's 7-bit mantissa (their 10 bits
would be cut); without native bf16 every op converts and bfloat16 runs slower than float32; and
on a CPU whose bf16 support is unknown (not x86) a quantized model stays float32.
``--dtype float32`` is the exact mode: greedy outputs equal transformers' in float32, and the
reference tests pin it (``PDSERVE_DTYPE=float32`` for every process the test session launches).
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
        if stored not in ("bfloat16", "quantized"):
            return torch.float32, f"auto on CPU with {stored} weights (bfloat16 would round them)"
        if fast is False:
            return torch.float32, "auto on a CPU without AVX512-BF16/AMX (bfloat16 would run slower)"
        if fast is None and stored == "quantized":
            # bfloat16 rounds a quantized model's values: only worth it where it is known to be fast
            return torch.float32, "auto on a CPU whose bf16 support is unknown, with quantized weights"
        return torch.bfloat16, f"auto on CPU with {stored} weights and native bf16 instructions"
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
