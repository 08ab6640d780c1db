"""Skip markers for tests that need this CPU's small-batch C kernels (and so the C decode stack), and
the float32 panels of CPUs without AVX-512F for the float32 stack's tests."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_linear
from engine.kernels import cpu_native


def small_batch_kernels() -> bool:
    """True iff the small-batch kernels are built here and bfloat16 weights are packed for them: the
    condition under which ``DecodeStack.build`` can take a model's matmuls."""
    return cpu_native.gemv_available() and cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16))


needs_small_batch_kernels = pytest.mark.skipif(
    not small_batch_kernels(),
    reason="this CPU has no AVX512-BF16: the small-batch kernels (and so the stack) are not built here",
)


def portable_float32_panels(monkeypatch) -> None:
    """Pack float32 layer weights as panels here even without AVX-512F: the library's portable loop
    (``pdserve_gemm_panels_f32`` built without AVX-512F) computes the same sums in the same order, so the
    float32 decode stack and the layer path both run on them; skips where no kernel library builds.
    Call before the model loads. Slow (one thread, scalar): small models only."""
    if cpu_native.load() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    if not cpu_native.panels_f32_available():
        monkeypatch.setattr(cpu_native, "panels_f32_available", lambda: True)
