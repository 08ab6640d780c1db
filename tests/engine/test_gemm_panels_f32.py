"""The float32 panel matmul (``pdserve_gemm_panels_f32`` in ``engine/kernels/cpu_gemm_pairs.c``) behind
``engine.cpu_linear``: its layout, its products against float64 ones (1-64 rows, bias, strided rows),
its refusals (of the AVX-512F kernel or, without AVX-512F, of its portable loop), which float32
weights keep the layout and which calls ``linear`` sends it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear
from engine.cpu_linear import PANELS_F32, linear, pack, to_panels_f32
from engine.kernels import cpu_native

# The kernel's products and refusals run anywhere the library builds (without AVX-512F: its portable
# loop, the same sums in the same order); which weights are packed as panels needs AVX-512F.
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler: the kernels cannot be built"),
]
needs_avx512f = pytest.mark.skipif(
    not cpu_native.panels_f32_available(),
    reason="this CPU has no AVX-512F: float32 weights keep oneDNN's layout here",
)


def test_the_layout_puts_sixteen_outputs_of_one_input_side_by_side():
    w = torch.arange(128 * 6, dtype=torch.float32).view(128, 6)
    p = to_panels_f32(w)
    assert p.shape == (2, 6, 4, 16)
    for o, k in ((0, 0), (17, 3), (64, 5), (127, 4), (80, 1)):
        assert p[o // 64, k, o % 64 // 16, o % 16] == w[o, k]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("shape", [(960, 576), (64, 95), (576, 1536)])
def test_products_are_float32_sums_of_the_exact_ones(rows, shape):
    """Every output within float32 summation error of the float64 product (relative to the terms'
    magnitudes), odd input widths and a row stride other than the width included."""
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    w = torch.randn(*shape, generator=g) * 0.05
    bias = torch.randn(shape[0], generator=g)
    x = torch.randn(rows, shape[1] + 10, generator=g)[:, 5 : 5 + shape[1]]  # strided rows
    y = cpu_native.gemm_panels_f32(x, to_panels_f32(w), shape[0], bias)
    assert y is not None and y.shape == (rows, shape[0]) and y.dtype == torch.float32
    ref = x.double() @ w.double().T + bias.double()
    magnitude = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - ref).abs() <= magnitude * shape[1] * 2.0**-24).all()
    assert not torch.equal(y, torch.zeros_like(y))


def test_the_kernel_refuses_what_it_cannot_take():
    w = to_panels_f32(torch.randn(64, 96))
    assert cpu_native.gemm_panels_f32(torch.randn(1, 96), w, 96, None) is None  # out % 64
    assert cpu_native.gemm_panels_f32(torch.randn(0, 96), w, 64, None) is None  # no rows


@needs_avx512f
def test_which_float32_weights_are_kept_as_panels():
    """A layer's weight: panels only (no oneDNN copy: one copy of the bytes). The LM-head-sized weight
    and shapes the kernel cannot take keep oneDNN's layout."""
    layer = pack(torch.randn(192, 576))
    assert layer.pairs is not None and layer.pairs.dtype == torch.float32 and not layer.onednn
    assert layer.data is layer.pairs
    assert cpu_linear.small_kernel(layer)[0] == PANELS_F32 and cpu_linear.small_rows(layer) == cpu_linear.PANELS_ROWS
    odd = pack(torch.randn(72, 96))  # 72 outputs: no panels
    assert odd.pairs is None and odd.onednn
    head = pack(torch.randn(cpu_linear.GEMV_MAX_BYTES // (4 * 64) + 64, 64))  # over GEMV_MAX_BYTES: oneDNN
    assert head.pairs is None and head.onednn and cpu_linear.small_rows(head) == 0


@needs_avx512f
def test_linear_sends_every_float32_call_on_a_panel_weight_to_the_kernel(monkeypatch):
    """Decode-sized and prompt-sized calls (beyond oneDNN's 512-row chunks too), a leading batch
    dimension, a strided input and a strided bias all give F.linear's result through the kernel."""
    w, bias = torch.randn(192, 576) * 0.05, torch.randn(192)
    p = pack(w)
    calls, real = [], cpu_native.gemm_panels_f32
    monkeypatch.setattr(cpu_native, "gemm_panels_f32", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 33, 700):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(linear(x, p, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 600)[..., 10:586]  # strided rows of a 3-D input
    b2 = torch.randn(384)[::2]  # a strided bias: added after the kernel
    torch.testing.assert_close(linear(x3, p, b2), F.linear(x3, w, b2), rtol=1e-5, atol=1e-5)
    linear(torch.randn(2, 576).bfloat16(), pack(w.bfloat16()))  # a bfloat16 weight never reaches it
    assert calls == [1, 33, 700, 10]
    assert cpu_linear.warm_up([(p, bias)]) == 0  # no oneDNN primitive to build for it
