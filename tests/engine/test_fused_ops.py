"""The fused CPU ops (engine/kernels/cpu_fused.c through engine/kernels/fused.py) against the torch
references they replace: float32 to float32 rounding, bfloat16 to one bfloat16 rounding step."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_native, fused

pytestmark = pytest.mark.unit
needs_kernel = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler: the kernels cannot be built")

TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576: over PARALLEL_ELEMENTS, threads
def test_rms_norm_matches_the_reference(dtype, rows):
    x, w = _rand(rows, 576, dtype=dtype), _rand(576, dtype=dtype, seed=1)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5), **TOL[dtype])


@needs_kernel
def test_rms_norm_reads_strided_rows():
    """A column slice of a wider tensor (rows apart by the full width) is read in place."""
    wide, w = _rand(5, 100, dtype=torch.float32), _rand(40, dtype=torch.float32, seed=1)
    x = wide[:, 10:50]
    assert not x.is_contiguous()
    got = fused.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, fused.rms_norm_ref(x.contiguous(), w, 1e-6), **TOL[torch.float32])
    assert got.is_contiguous()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_the_stream_in_place_and_norms_the_sum(dtype):
    h, r, w = _rand(9, 64, dtype=dtype), _rand(9, 64, dtype=dtype, seed=2), _rand(64, dtype=dtype, seed=3)
    want_sum = h + r
    want = fused.rms_norm_ref(want_sum, w, 1e-5)
    ptr = h.data_ptr()
    s, out = fused.add_rms_norm(h, r, w, 1e-5)
    assert s.data_ptr() == ptr  # the residual stream was updated, not copied
    torch.testing.assert_close(s, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, want, **TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_a_fused_qkv_view_in_place(dtype):
    from engine.rope import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, 10000.0, "cpu")
    qkv = _rand(11, (9 + 3 + 3) * 64, dtype=dtype)
    q = qkv[:, : 9 * 64].view(11, 9, 64)  # tokens strided by the QKV row, heads contiguous
    pos = torch.tensor([0, 1, 2, 3, 100, 101, 7, 8, 9, 500, 511])
    want = fused.rope_ref(q.clone(), pos, rope.cos, rope.sin)
    untouched = qkv[:, 9 * 64 :].clone()
    got = rope.apply(q, pos)
    assert got.data_ptr() == q.data_ptr()
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(qkv[:, 9 * 64 :], untouched, rtol=0, atol=0)  # K and V columns kept


@needs_kernel
def test_rope_refuses_a_position_outside_its_table():
    from engine.rope import RotaryEmbedding

    rope = RotaryEmbedding(16, 8, 10000.0, "cpu")
    with pytest.raises(IndexError, match="outside 0..7"):
        rope.apply(torch.zeros(1, 2, 16), torch.tensor([8]))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 257])  # 257 x 3072: over PARALLEL_ELEMENTS, threads
def test_silu_mul_matches_the_reference_over_a_wide_range(dtype, rows):
    gu = _rand(rows, 2 * 1536, dtype=dtype) * 8  # |gate| up to ~40: both sigmoid branches, tails
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    torch.testing.assert_close(fused.silu_mul(gu), fused.silu_mul_ref(gu), **TOL[dtype])


@needs_kernel
def test_bfloat16_silu_mul_is_within_one_rounding_of_the_exact_value():
    """The bfloat16 kernel (a fast exp and reciprocal on AVX512-BF16) rounds to the nearest bfloat16
    of the float64 value, or to its neighbour when that value sits on a rounding edge: never further."""
    gu = _rand(257, 2 * 1536, dtype=torch.bfloat16) * 8
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    got, exact = fused.silu_mul(gu).double(), fused.silu_mul_ref(gu.double())
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)  # bfloat16 spacing at exact
    assert bool(((got - exact).abs() <= ulp + 1e-30).all())
    assert (got != exact.bfloat16().double()).float().mean() < 1e-3  # almost always the nearest


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_a_float32_scale_matches_the_reference(dtype, rows):
    """Gemma's norm: the float32 scale ``1 + weight`` is not rounded to bfloat16; strided head views
    (a fused QKV row's query heads) give the same values as their contiguous copy."""
    x, scale = _rand(rows, 576, dtype=dtype), 1 + _rand(576, dtype=torch.float32, seed=1) * 0.3
    want = fused.rms_norm_f32w_ref(x, scale, 1e-6)
    torch.testing.assert_close(fused.rms_norm_f32w(x, scale, 1e-6), want, **TOL[dtype])
    heads = _rand(rows, 6 * 64, dtype=dtype)[:, : 4 * 64].view(rows, 4, 64)
    got = fused.rms_norm_f32w(heads, scale[:64].contiguous(), 1e-6)
    assert got.shape == heads.shape and torch.equal(got, fused.rms_norm_f32w(heads.contiguous(), scale[:64], 1e-6))
    torch.testing.assert_close(got, fused.rms_norm_f32w_ref(heads, scale[:64], 1e-6), **TOL[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 257])
def test_gelu_tanh_mul_matches_the_reference_over_a_wide_range(dtype, rows):
    """Both signs and the tails (|gate| up to ~40, +-100, zeros), an inner size that is no multiple of
    the vector width. float32: within 4e-7 of |gate * up| of the float64 value (torch's own
    ``1 + tanh`` cancels where the gate is very negative, so it is held to the exact value, not torch's)."""
    gu = _rand(rows, 2 * 1539, dtype=dtype) * 8
    gu[0, :5] = torch.tensor([0.0, -100.0, 100.0, -0.0, 1e-3])
    got = fused.gelu_tanh_mul(gu)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, fused.gelu_tanh_mul_ref(gu), **TOL[dtype])
    else:
        gate, up = gu.double().chunk(2, dim=-1)
        error = (got.double() - fused.gelu_tanh_mul_ref(gu.double())).abs()
        assert bool((error <= 4e-7 * (gate * up).abs()).all())


def test_without_the_kernels_every_op_is_the_reference(monkeypatch):
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    x, w = _rand(3, 32, dtype=torch.float32), _rand(32, dtype=torch.float32, seed=1)
    assert torch.equal(fused.rms_norm(x, w, 1e-5), fused.rms_norm_ref(x, w, 1e-5))
    gu = _rand(3, 64, dtype=torch.float32)
    assert torch.equal(fused.silu_mul(gu), fused.silu_mul_ref(gu))
    assert torch.equal(fused.gelu_tanh_mul(gu), fused.gelu_tanh_mul_ref(gu))
    assert torch.equal(fused.rms_norm_f32w(x, w, 1e-5), fused.rms_norm_f32w_ref(x, w, 1e-5))
    s, out = fused.add_rms_norm(x.clone(), x, w, 1e-5)
    assert torch.equal(s, x + x) and torch.equal(out, fused.rms_norm_ref(x + x, w, 1e-5))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_put_writes_and_nothing_else(dtype):
    pages, layers, P, heads, dim = 6, 3, 4, 2, 16
    buf = _rand(pages, layers, 2, P, heads, dim, dtype=dtype)
    want = buf.clone()
    qkv = _rand(5, 3 * heads * dim, dtype=dtype, seed=4)
    k = qkv[:, heads * dim : 2 * heads * dim].view(5, heads, dim)  # strided views, as the model passes them
    v = qkv[:, 2 * heads * dim :].view(5, heads, dim)
    slots = torch.tensor([0, 5, 7, 22, 13])
    want[slots // P, 1, :, slots % P] = torch.stack((k, v), 1)
    assert fused.store_kv(buf, 1, slots, k, v)
    assert torch.equal(buf, want)


def test_store_kv_declines_what_it_cannot_copy():
    buf = torch.zeros(2, 1, 2, 4, 2, 8)
    k = torch.zeros(3, 2, 8, dtype=torch.float64)
    assert not fused.store_kv(buf, 0, torch.tensor([0, 1, 2]), k, k)  # another dtype
    k32 = torch.zeros(3, 8, 2).transpose(1, 2)  # head rows not contiguous
    assert not fused.store_kv(buf, 0, torch.tensor([0, 1, 2]), k32, k32)


@needs_kernel
def test_cpu_backend_refuses_a_slot_outside_the_pool():
    from cache.kv_pools import KVPools
    from engine.attention import CpuBackend
    from tests.engine.test_cpu_attention import _windows
    from tests.support.swa import PAGE, TYPES, decode_batch

    pools = KVPools(8, 8, TYPES, PAGE, 2, 16, torch.float32, "cpu")
    batch = decode_batch(pools, [3, 9], 8)
    backend = CpuBackend(pools, 4, 0.25, _windows(8), threads=1)
    backend.prepare(batch)
    name = pools.layer_pool[1][0]
    table, slots = batch.pool_index(name)
    slots.fill_(pools.pool(name).num_pages * PAGE)  # one past the end
    with pytest.raises(IndexError, match="slot outside"):
        backend.store(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), 1)
