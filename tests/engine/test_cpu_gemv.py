"""The small-batch bfloat16 matmul kernel (engine/kernels/cpu_gemv.c) behind engine.cpu_linear."""

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear
from engine.cpu_linear import GEMV_MAX_BYTES, linear, pack
from engine.kernels import cpu_native, decode_prefetch

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not cpu_native.gemv_available(), reason="this CPU has no AVX512-BF16: the gemv kernel is not built here"
    ),
]


def _exact_rounded(x, w, bias):
    ref = x.double() @ w.double().T
    if bias is not None:
        ref = ref + bias.double()
    return ref


def _check(y, ref):
    """Every output is the exact result rounded to bfloat16, up to one bfloat16 step where the
    float32 sum sat next to a rounding boundary."""
    step = ref.abs().float().clamp_min(1e-30) * 2.0**-7
    assert ((y.double() - ref).abs() <= step.double()).all()
    assert (y == ref.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (64, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_the_exact_product(shape, rows, with_bias):
    """Either prefetch mode, the same bits (prefetching moves no arithmetic)."""
    torch.manual_seed(rows)
    w = torch.randn(*shape).bfloat16()
    bias = torch.randn(shape[0]).bfloat16() if with_bias else None
    x = torch.randn(rows, shape[1]).bfloat16()
    y = cpu_native.gemv_bf16(x, w, bias, cpu_native.PREFETCH_L1)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    _check(y, _exact_rounded(x, w, bias))
    assert torch.equal(y, cpu_native.gemv_bf16(x, w, bias, cpu_native.PREFETCH_L2))


def test_strided_rows_and_refused_shapes():
    w = torch.randn(64, 96).bfloat16()
    base = torch.randn(3, 160).bfloat16()
    x = base[:, :96]  # rows 160 apart
    _check(cpu_native.gemv_bf16(x, w, None), _exact_rounded(x, w, None))
    assert cpu_native.gemv_bf16(torch.randn(9, 96).bfloat16(), w, None) is None  # over 8 rows
    assert cpu_native.gemv_bf16(torch.randn(1, 80).bfloat16(), torch.randn(64, 80).bfloat16(), None) is None


def test_pack_keeps_the_plain_weight_only_where_the_kernel_takes_it():
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    assert pack(torch.randn(968, 576).bfloat16()).plain is not None  # 968 outputs: no 64-output panels
    if cpu_native.pairs_available():  # where the pair-panel kernel takes the shape it holds that layout instead
        p = pack(torch.randn(960, 576).bfloat16())
        assert p.plain is None and p.pairs is not None
    assert pack(torch.randn(100, 576).bfloat16()).plain is None  # 100 outputs: not a multiple of 8
    assert pack(torch.randn(960, 576)).plain is None  # float32
    big = torch.empty(GEMV_MAX_BYTES // (2 * 576) + 8, 576, dtype=torch.bfloat16)
    assert pack(big).plain is None


def test_linear_routes_small_batches_to_the_kernel(monkeypatch):
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    top = cpu_linear.gemv_rows()  # 4 or 8 as this machine's probe found (timed before the patch below)
    calls = []
    real = cpu_native.gemv_bf16
    monkeypatch.setattr(cpu_native, "gemv_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(584, 576).bfloat16()  # 584 outputs: this kernel's (8 | out), not the pair panels' (64)
    p = pack(w)
    for rows in (1, top, top + 1, 64):
        x = torch.randn(2, rows, 576).bfloat16()[0]
        y = linear(x, p)
        assert y.shape == (rows, 584)
        torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=1.6e-2, atol=1e-2)
    assert calls == [1, top]  # more rows stay on oneDNN


@pytest.mark.parametrize(
    "kernel_s,onednn_s,want", [(1.0, 2.0, cpu_native.GEMV_MAX_ROWS), (2.0, 1.0, cpu_linear.GEMV_ROWS)]
)
def test_the_kernel_takes_eight_rows_only_where_it_beats_onednn_there(monkeypatch, kernel_s, onednn_s, want):
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    monkeypatch.delenv(decode_prefetch.ENV, raising=False)
    seen = []
    monkeypatch.setattr(cpu_linear, "time_against_onednn", lambda n, mode: seen.append(mode) or (kernel_s, onednn_s))
    cpu_linear.gemv_rows.cache_clear()
    try:
        assert cpu_linear.gemv_rows() == want
        assert cpu_linear.gemv_rows() == want
    finally:
        cpu_linear.gemv_rows.cache_clear()
    assert seen == [decode_prefetch.modes().gemv]  # timed once, in the kernel's chosen mode


def test_a_forced_prefetch_mode_keeps_the_default_rows_untimed(monkeypatch):
    monkeypatch.setenv(decode_prefetch.ENV, "l2")
    monkeypatch.setattr(cpu_linear, "time_against_onednn", lambda *a: pytest.fail("must not time"))
    cpu_linear.gemv_rows.cache_clear()
    try:
        assert cpu_linear.gemv_rows() == cpu_linear.GEMV_ROWS
    finally:
        cpu_linear.gemv_rows.cache_clear()


@pytest.mark.parametrize("pairs_all", [False, True])
def test_kernel_against_onednn_times_both_on_real_weights(monkeypatch, pairs_all):
    """oneDNN is timed on its own layout even where ``pack`` would keep the weight as pair panels."""
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    monkeypatch.setattr(cpu_linear, "pairs_take_all", lambda: pairs_all)
    seen, real = [], cpu_linear._packed_rows
    monkeypatch.setattr(cpu_linear, "_packed_rows", lambda x, w, b: seen.append(w.data.layout) or real(x, w, b))
    kernel, onednn = cpu_linear.time_against_onednn(8 << 20, cpu_native.PREFETCH_L2, rounds=1)
    assert 0 < kernel < 10 and 0 < onednn < 10
    assert seen and set(seen) == {torch._mkldnn}
