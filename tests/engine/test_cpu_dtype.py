"""bf16 on a CPU without native bf16 falls back to fp32 (it would be slower there)."""

from __future__ import annotations

import logging

import torch

from engine.cpu_features import has_fast_bf16
from engine.model_runner import resolve_dtype

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}


def test_bf16_falls_back_to_fp32_without_native_bf16(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("bfloat16", cpu, AVX2) is torch.float32
    assert "AVX512_BF16" in caplog.text and "float32" in caplog.text
    assert resolve_dtype("bfloat16", cpu, AVX512_BF16) is torch.bfloat16
    assert resolve_dtype("bfloat16", cpu, AVX2 | {"amx_bf16"}) is torch.bfloat16
    assert resolve_dtype("float16", cpu, AVX2) is torch.float16 and resolve_dtype("auto", cpu, AVX2) is torch.float32


def test_unknown_cpus_are_trusted():
    assert has_fast_bf16(frozenset()) is None
    assert has_fast_bf16(frozenset({"fp", "asimd", "bf16"})) is None  # aarch64: no x86 flags
    assert resolve_dtype("bfloat16", torch.device("cpu"), frozenset({"fp", "asimd"})) is torch.bfloat16
