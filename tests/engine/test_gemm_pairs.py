"""The pair-panel matmul kernel (``engine/kernels/cpu_gemm_pairs.c``) behind ``engine.cpu_linear``: its
layout, its products against the exact ones (bfloat16 and weight-only int8 weights, 1-64 rows, bias,
strided rows), its refusals, which calls ``linear`` sends it, and the probe that sets its row limit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear
from engine.cpu_linear import linear, pack, quantize_int8, to_pairs
from engine.kernels import cpu_native, decode_prefetch

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(
        not cpu_native.pairs_available(), reason="this CPU has no AVX512-BF16: the pair-panel kernel is not built here"
    ),
]


def test_the_layout_puts_sixteen_outputs_of_one_input_pair_side_by_side():
    w = torch.arange(128 * 6, dtype=torch.float32).view(128, 6)
    p = to_pairs(w)
    assert p.shape == (2, 3, 4, 16, 2)
    for o, k in ((0, 0), (17, 3), (64, 5), (127, 4), (80, 1)):
        assert p[o // 64, k // 2, o % 64 // 16, o % 16, k % 2] == w[o, k]


def _check(y, ref, magnitude):
    """The exact result rounded to bfloat16 once, up to one bfloat16 step where the float32 sum sat
    next to a rounding boundary, plus float32 summation error relative to the terms' magnitude."""
    step = ref.abs() * 2.0**-7 + magnitude * 2.0**-20
    assert ((y.double() - ref).abs() <= step).all()
    assert (y == ref.to(torch.bfloat16)).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("shape", [(960, 576), (64, 96), (576, 1536)])
@pytest.mark.parametrize("int8", [False, True])
def test_products_are_the_exact_ones_rounded_once(rows, shape, int8):
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    w = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=g).bfloat16()
    x = torch.randn(rows, shape[1] + 10, generator=g).bfloat16()[:, 5 : 5 + shape[1]]  # strided rows
    if int8:
        q = quantize_int8(w)
        y = cpu_native.gemm_pairs(x, q.pairs, shape[0], bias, q.scale)
        wd = q.q.double() * q.scale.double()[:, None]
    else:
        y = cpu_native.gemm_pairs(x, to_pairs(w), shape[0], bias)
        wd = w.double()
    assert y is not None and y.shape == (rows, shape[0]) and y.dtype == torch.bfloat16
    ref = x.double() @ wd.T + bias.double()
    _check(y, ref, x.double().abs() @ wd.abs().T + bias.double().abs())


def test_the_kernel_refuses_what_it_cannot_take():
    w = to_pairs(torch.randn(64, 96).bfloat16())
    assert cpu_native.gemm_pairs(torch.randn(1, 96).bfloat16(), w, 96, None) is None  # out % 64
    assert cpu_native.gemm_pairs(torch.randn(1, 95).bfloat16(), w, 64, None) is None  # odd in
    assert cpu_native.gemm_pairs(torch.randn(0, 96).bfloat16(), w, 64, None) is None  # no rows
    assert quantize_int8(torch.randn(72, 96).bfloat16()).pairs is None  # 72 outputs: no panels


@pytest.mark.parametrize("int8", [False, True])
def test_linear_sends_calls_of_up_to_pairs_rows_to_the_kernel(monkeypatch, int8):
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    top = cpu_linear.pairs_rows()  # as this machine's probe found (timed before the patch below)
    monkeypatch.setattr(cpu_linear, "pairs_take_all", lambda: False)  # both copies: oneDNN for long calls
    w = (torch.randn(192, 576) * 0.05).bfloat16()
    p = pack(w, int8=int8)
    assert (p.int8.pairs if int8 else p.pairs) is not None and p.plain is None
    assert cpu_linear.small_rows(p) == top
    calls, real = [], cpu_native.gemm_pairs
    monkeypatch.setattr(cpu_native, "gemm_pairs", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ref_w = p.int8.dequantize(torch.bfloat16) if int8 else w
    for rows in (1, top, top + 1):
        x = torch.randn(rows, 576).bfloat16()
        torch.testing.assert_close(linear(x, p).float(), F.linear(x, ref_w).float(), rtol=1.6e-2, atol=1e-2)
    assert calls == [1, top]  # more rows stay on oneDNN


def test_a_bfloat16_weight_kept_only_as_pairs_serves_every_call(monkeypatch):
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    monkeypatch.setattr(cpu_linear, "pairs_take_all", lambda: True)
    w, bias = (torch.randn(192, 576) * 0.05).bfloat16(), torch.randn(192).bfloat16()
    p = pack(w)
    assert not p.onednn and p.data is p.pairs and p.plain is None and cpu_linear.small_rows(p) == cpu_linear.PANELS_ROWS
    calls, real = [], cpu_native.gemm_pairs
    monkeypatch.setattr(cpu_native, "gemm_pairs", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows, b in ((1, None), (200, bias), (700, bias), (3, bias.float())):  # a float32 bias: added after
        x = torch.randn(rows, 576).bfloat16()
        torch.testing.assert_close(
            linear(x, p, b).float(), F.linear(x, w, b if b is None else b.bfloat16()).float(), rtol=1.6e-2, atol=1e-2
        )
    x = torch.randn(2, 5, 576)  # float32 rows on a bfloat16 weight: made bfloat16 first
    assert linear(x, p).shape == (2, 5, 192) and linear(x, p).dtype == torch.bfloat16
    assert calls[:4] == [1, 200, 700, 3]  # every row count, no padding to a bucket, no oneDNN
    head = pack(torch.randn(16384, 576).bfloat16())  # 18.9 MB: past GEMV_MAX_BYTES, an LM head's size class
    assert not head.onednn and head.pairs is not None and cpu_linear.small_rows(head) == cpu_linear.PANELS_ROWS


def test_pairs_take_all_only_without_amx(monkeypatch):
    try:
        for flags, env, want in (
            (frozenset({"avx512_bf16"}), "1", True),
            (frozenset({"avx512_bf16", "amx_bf16"}), "1", False),
            (frozenset({"avx512_bf16"}), "0", False),
        ):
            monkeypatch.setattr(cpu_linear, "cpu_flags", lambda f=flags: f)
            monkeypatch.setenv("PDSERVE_PAIRS_ALL", env)
            cpu_linear.pairs_take_all.cache_clear()
            assert cpu_linear.pairs_take_all() is want
    finally:
        cpu_linear.pairs_take_all.cache_clear()


def _probe(monkeypatch, pairs_s: dict[int, float]):
    """pairs_rows() with the kernel timed at ``pairs_s[rows]`` seconds and oneDNN at 1.0."""
    monkeypatch.delenv(decode_prefetch.ENV, raising=False)
    monkeypatch.setattr(cpu_linear, "_layer_probe", lambda n: [torch.zeros(64, 64, dtype=torch.bfloat16)])
    seen = []

    def best_of(runs, rounds):  # called once per probed row count, largest first
        seen.append(cpu_linear.PAIRS_PROBE_ROWS[len(seen)])
        return {"pairs": pairs_s[seen[-1]], "onednn": 1.0}

    monkeypatch.setattr(decode_prefetch, "best_of", best_of)
    cpu_linear.pairs_rows.cache_clear()
    try:
        return cpu_linear.pairs_rows(), len(seen)
    finally:
        cpu_linear.pairs_rows.cache_clear()


def test_the_probe_keeps_the_largest_row_count_the_kernel_wins(monkeypatch):
    if not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)):
        pytest.skip("bfloat16 weights are not packed on this CPU")
    assert _probe(monkeypatch, {64: 0.9, 32: 0.9, 16: 0.9, 8: 0.9}) == (64, 1)  # one timing when 64 wins
    assert _probe(monkeypatch, {64: 1.2, 32: 1.1, 16: 0.95, 8: 0.9}) == (16, 3)
    assert _probe(monkeypatch, {64: 2.0, 32: 2.0, 16: 2.0, 8: 2.0}) == (cpu_linear.PAIRS_MIN_ROWS, 4)
    monkeypatch.setenv(decode_prefetch.ENV, "l2")  # a forced prefetch mode: not timed
    cpu_linear.pairs_rows.cache_clear()
    try:
        assert cpu_linear.pairs_rows() == cpu_linear.PAIRS_ROWS
    finally:
        cpu_linear.pairs_rows.cache_clear()
