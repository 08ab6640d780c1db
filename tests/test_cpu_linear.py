"""engine.cpu_linear: CPU float32 weights are packed for oneDNN and give F.linear's result (up to
float32 rounding) at decode and prefill row counts, with bias and batched inputs; other weights
stay plain tensors and go through F.linear unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import PackedWeight, linear, pack


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 8, 33, 512])
def test_packed_linear_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    p = pack(w)
    assert isinstance(p, PackedWeight) and p.shape == w.shape
    torch.testing.assert_close(linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, p, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, 64).expand(2, rows, 64)
    assert linear(x3, p).shape == (2, rows, 96)
    torch.testing.assert_close(linear(x[:, ::2].repeat(1, 2), p), F.linear(x[:, ::2].repeat(1, 2), w),
                               rtol=1e-5, atol=1e-4)


def test_other_weights_stay_plain():
    w16 = torch.randn(8, 4).to(torch.bfloat16)
    assert pack(w16) is w16
    assert pack(torch.randn(3)).dim() == 1  # not a matrix
    x = torch.randn(2, 4).to(torch.bfloat16)
    assert torch.equal(linear(x, w16), F.linear(x, w16))
