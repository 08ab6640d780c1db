"""Skip markers for tests that need this CPU's small-batch C kernels (and so the C decode stack)."""

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
