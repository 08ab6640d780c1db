"""The C CPU decode kernel (engine.kernels.cpu_native via engine.attention.CpuBackend) against
the torch backend: hybrid pools (full + SWA, SWA page 0 poisoned), sliding windows, GQA groups,
mixed context lengths, 1 and 3 threads; backend selection and the fallbacks when the kernel
cannot be had."""

from __future__ import annotations

import logging

import pytest
import torch

from cache.kv_pools import KVPools
from engine.attention import CpuBackend, TorchBackend, make_backend
from engine.kernels import cpu_library, cpu_native
from tests.support.swa import PAGE, TYPES, decode_batch

needs_kernel = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler for the CPU kernel")


def _windows(window):
    return [window if t == "sliding_attention" else None for t in TYPES]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("window", [5, 8, 13])
def test_cpu_kernel_decode_equals_the_torch_backend_on_a_hybrid_pool(window, threads, dtype):
    """bfloat16 pools too: the kernel widens each key exactly, so against the torch path on a float32
    query the sums agree to float32 rounding."""
    g = torch.Generator().manual_seed(window * 10 + threads)
    pools = KVPools(64, 64, TYPES, PAGE, 2, 16, dtype, "cpu")
    pools.units.copy_(torch.randn(pools.units.shape, generator=g).to(pools.units.dtype))
    pools.swa.buffer[0] = 1e3  # someone else's page: reading it unmasked would show
    seq_lens = [1, 3, 17, 30, 41]
    batch = decode_batch(pools, seq_lens, window)
    want, got = TorchBackend(pools, 4, 0.25, _windows(window)), CpuBackend(pools, 4, 0.25, _windows(window), threads)
    want.prepare(batch)
    got.prepare(batch)
    q = torch.randn(len(seq_lens), 4 * 16, generator=g)
    for layer in range(len(TYPES)):
        torch.testing.assert_close(
            got._decode(q.view(-1, 4, 16), layer, batch),
            want._decode(q.view(-1, 4, 16), layer, batch),
            rtol=1e-5,
            atol=1e-5,
        )


@needs_kernel
@pytest.mark.parametrize("prefetch", [cpu_native.PREFETCH_L1, cpu_native.PREFETCH_L2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(1, 8), (3, 64), (4, 256), (12, 32)])  # 12: the unspecialized group path
def test_cpu_kernel_matches_sdpa_for_gqa_groups_and_long_contexts(group, head_dim, dtype, prefetch):
    """Either row prefetch mode: the same output to the bit (prefetching moves no arithmetic)."""
    g = torch.Generator().manual_seed(group)
    kv_heads, pages, P = 2, 96, 16
    pools = KVPools(pages, 0, ("full_attention",) * 2, P, kv_heads, head_dim, dtype, "cpu")
    pools.units.copy_(torch.randn(pools.units.shape, generator=g).to(pools.units.dtype))
    seq_lens = [700, 5, 64, 1]  # one long request among short ones: no padding to the longest
    order = torch.randperm(pages, generator=g).tolist()
    rows, used = [], 0
    for n in seq_lens:
        k = -(-n // P)
        rows.append(order[used : used + k] + [0] * (44 - k))
        used += k
    table = torch.tensor(rows)
    hi, lo = torch.tensor(seq_lens), torch.zeros(len(seq_lens), dtype=torch.int64)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g)
    got = cpu_native.paged_decode(q, pools.full.buffer, 1, table, lo, hi, head_dim**-0.5, 2, prefetch, dot=False)
    other = cpu_native.PREFETCH_L2 if prefetch == cpu_native.PREFETCH_L1 else cpu_native.PREFETCH_L1
    assert torch.equal(
        got, cpu_native.paged_decode(q, pools.full.buffer, 1, table, lo, hi, head_dim**-0.5, 2, other, dot=False)
    )
    for i, n in enumerate(seq_lens):
        pg = table[i, : -(-n // P)]
        k = pools.full.buffer[pg, 1, 0].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        v = pools.full.buffer[pg, 1, 1].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        ref = torch.nn.functional.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, enable_gqa=True)
        torch.testing.assert_close(got[i], ref.squeeze(1), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.skipif(not cpu_native.decode_dot_available(), reason="the kernels were built without AVX512-BF16")
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 32), (8, 128), (12, 64)])  # 12: the unspecialized group
@pytest.mark.parametrize("prefetch", [cpu_native.PREFETCH_L1, cpu_native.PREFETCH_L2])
def test_cpu_decode_bfloat16_products_within_one_rounding_of_the_weights(group, head_dim, prefetch):
    """``dot`` on a bfloat16 pool: products in bfloat16 (the query is a bfloat16 one, so exact), the
    softmax weights rounded to bfloat16 for P.V. Against float64 attention on the same values the
    error is within twice the weights' rounding (2^-9 relative each), for ranges that start mid-page, end on
    odd and even counts, span blocks of 64 and pages shuffled through the pool; every page outside
    the tables is poisoned. Either prefetch mode gives the same bits, and the result is not the
    float32-math path's (the flag reaches the kernel)."""
    g = torch.Generator().manual_seed(group * 7 + head_dim)
    kv_heads, pages, P = 2, 120, 16
    pool = torch.randn(pages, 2, 2, P, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    spans = [(0, 700), (5, 6), (3, 64), (0, 1), (17, 130), (0, 129)]
    order = torch.randperm(pages, generator=g).tolist()
    table = torch.zeros(len(spans), 44, dtype=torch.int64)
    for i, (_, hi_) in enumerate(spans):
        for j in range(-(-hi_ // P)):
            table[i, j] = order.pop()
    for p in order:
        pool[p] = 1e4
    lo, hi = torch.tensor([a for a, _ in spans]), torch.tensor([b for _, b in spans])
    q = torch.randn(len(spans), kv_heads * group, head_dim, generator=g).to(torch.bfloat16)
    scale = head_dim**-0.5
    got = cpu_native.paged_decode(q, pool, 1, table, lo, hi, scale, 2, prefetch, dot=True)
    assert torch.equal(got, cpu_native.paged_decode(q, pool, 1, table, lo, hi, scale, 1, 1 - prefetch, dot=True))
    for i, (a, b) in enumerate(spans):
        pg = table[i, : -(-b // P)]
        k = pool[pg, 1, 0].reshape(-1, kv_heads, head_dim)[a:b].transpose(0, 1).double()
        v = pool[pg, 1, 1].reshape(-1, kv_heads, head_dim)[a:b].transpose(0, 1).double()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[i].double().unsqueeze(1), k, v, scale=scale, enable_gqa=True
        ).squeeze(1)
        err = (got[i].double() - ref).norm() / ref.norm()
        assert err < 2**-8, (i, err)
    assert not torch.equal(got, cpu_native.paged_decode(q, pool, 1, table, lo, hi, scale, 2, prefetch, dot=False))


def test_backend_choice_on_cpu():
    pools32 = KVPools(8, 0, ("full_attention",), 4, 1, 8, torch.float32, "cpu")
    pools16 = KVPools(8, 0, ("full_attention",), 4, 1, 8, torch.bfloat16, "cpu")
    auto = make_backend("auto", pools32, 2, 1.0, [None])
    assert type(auto) is (CpuBackend if cpu_native.load() is not None else TorchBackend)
    assert type(make_backend("auto", pools16, 2, 1.0, [None])) is type(auto)  # bf16 pools too
    assert type(make_backend("torch", pools32, 2, 1.0, [None])) is TorchBackend
    pools_f16 = KVPools(8, 0, ("full_attention",), 4, 1, 8, torch.float16, "cpu")
    assert type(make_backend("auto", pools_f16, 2, 1.0, [None])) is TorchBackend  # float16: the torch path
    with pytest.raises(ValueError, match="--attention-backend torch"):
        make_backend("cpu", pools_f16, 2, 1.0, [None])


@pytest.mark.parametrize("env", [{"PDSERVE_NATIVE_KERNELS": "0"}, {"CC": "/bin/false"}])
def test_no_kernel_means_the_torch_path(monkeypatch, tmp_path, caplog, env):
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))  # nothing built yet: CC must run
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cpu_native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu_library"):
            assert cpu_native.load() is None
        pools = KVPools(8, 0, ("full_attention",), 4, 1, 8, torch.float32, "cpu")
        assert type(make_backend("auto", pools, 2, 1.0, [None])) is TorchBackend
        assert ("could not build" in caplog.text) == ("CC" in env)
        assert list(tmp_path.iterdir()) == []  # a failed build leaves no file behind
    finally:
        cpu_native.load.cache_clear()


@needs_kernel
def test_a_page_outside_the_pool_raises_instead_of_reading_memory():
    pools = KVPools(64, 64, TYPES, PAGE, 2, 16, torch.float32, "cpu")
    batch = decode_batch(pools, [3, 9], 8)
    batch.block_table[1, 0] = 64  # one past the last page
    backend = CpuBackend(pools, 4, 0.25, _windows(8))
    backend.prepare(batch)
    with pytest.raises(IndexError, match="outside 0..63"):
        backend._decode(torch.zeros(2, 4, 16), 1, batch)  # layer 1: a full-attention layer


def test_missing_kernel_source_means_the_torch_path(monkeypatch, tmp_path, caplog):
    """An install without the .c file (package data lost) degrades to the torch path, logged."""
    monkeypatch.setenv("PDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_library, "SOURCES", (tmp_path / "absent.c",))
    cpu_native.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu_library"):
            assert cpu_native.load() is None
        assert "could not build" in caplog.text and "absent.c" in caplog.text
    finally:
        cpu_native.load.cache_clear()


def test_kernel_threads_follow_the_work_of_the_step(monkeypatch):
    """Short steps run on the caller's thread (waking a worker would cost more than the work); long
    ones use up to every thread offered, never more; one thread whenever the kernels could not share
    torch's OpenMP runtime."""
    per = cpu_native.WORK_PER_THREAD
    monkeypatch.setattr(cpu_native, "openmp_shared", lambda: True)
    assert cpu_native.threads_for(0, 9, 64, 2) == 1
    assert cpu_native.threads_for(2 * 16, 9, 64, 2) == 1  # batch 2 at 16 tokens: ~18k multiply-adds
    assert cpu_native.threads_for(-(-2 * per // (9 * 64)), 9, 64, 2) == 2  # two threads of work
    assert cpu_native.threads_for(32 * 2048, 9, 64, 2) == 2
    assert cpu_native.threads_for(32 * 2048, 9, 64, 16) == 16
    monkeypatch.setattr(cpu_native, "openmp_shared", lambda: False)
    assert cpu_native.threads_for(32 * 2048, 9, 64, 16) == 1


@needs_kernel
def test_the_kernels_run_on_torchs_openmp_runtime():
    """Loading the kernels maps no second OpenMP runtime next to torch's (where torch uses libgomp)."""
    cpu_native.load()
    cpu_native.openmp_shared.cache_clear()
    assert cpu_native.openmp_shared()


def test_cpu_backend_starts_no_thread_for_a_short_step(monkeypatch):
    """The backend passes the kernel the threads the step's keys pay for, not torch's count."""
    seen = []
    real = cpu_native.paged_decode
    # paged_decode(q, pool, layer, table, lo, hi, scale, threads, prefetch, dot=...): threads is a[7]
    monkeypatch.setattr(cpu_native, "paged_decode", lambda *a, **kw: seen.append(a[7]) or real(*a, **kw))
    pools = KVPools(64, 64, TYPES, PAGE, 2, 16, torch.float32, "cpu")
    batch = decode_batch(pools, [3, 9], 8)
    backend = CpuBackend(pools, 4, 0.25, _windows(8), threads=2)
    backend.prepare(batch)
    backend._decode(torch.zeros(2, 4, 16), 1, batch)
    assert seen == [1]


def _extend_reference(q, pool, layer, table, pos0, ext, window, scale):
    """Dense float64 causal (windowed) attention of each request's new tokens over its keys."""
    P, outs, row = pool.shape[3], [], 0
    for b, (p0, n) in enumerate(zip(pos0.tolist(), ext.tolist())):
        seq = p0 + n
        pages = table[b, : -(-seq // P)]
        k = pool[pages, layer, 0].reshape(-1, *pool.shape[4:])[:seq].double()  # [seq, Hkv, D]
        v = pool[pages, layer, 1].reshape(-1, *pool.shape[4:])[:seq].double()
        qb = q[row : row + n].double()  # [n, H, D]
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("nhd,shd->hns", qb, k.repeat_interleave(g, 1)) * scale
        qpos, kpos = torch.arange(p0, seq)[:, None], torch.arange(seq)[None]
        ok = kpos <= qpos if window is None else (kpos <= qpos) & (kpos > qpos - window)
        s = s.masked_fill(~ok, float("-inf"))
        outs.append(torch.einsum("hns,shd->nhd", s.softmax(-1), v.repeat_interleave(g, 1)))
        row += n
    return torch.cat(outs).float()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    [
        (9, 3, 64, None),  # SmolLM2: 16 query tokens a tile
        (4, 1, 256, 40),  # Gemma 3's shape, a window shorter than the prompt
        (8, 8, 64, None),  # MHA: 48 tokens a tile
        (6, 1, 128, 7),  # group 6: tiles of 8 tokens, pad rows
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dot", [False, True])
def test_tiled_extend_kernel_equals_dense_attention(dtype, heads, kv_heads, head_dim, window, threads, dot):
    """Requests with and without a cached prefix, lengths that are not a multiple of the tile, a
    one-token chunk, pages shuffled through the pool; every page not in a table is poisoned. The
    bfloat16-product path (``dot`` on a bfloat16 pool, where the CPU has AVX512-BF16) rounds the
    scaled queries and the softmax weights to bfloat16 once each: against a reference given the same
    rounded queries it is within the weights' rounding (2^-9 relative), and it is not the float32
    path (outputs differ)."""
    g = torch.Generator().manual_seed(heads * 100 + head_dim + threads)
    P, layers, pos0, ext = 16, 2, [0, 60, 3, 0], [100, 37, 1, 150]
    need = [-(-(p + n) // P) for p, n in zip(pos0, ext)]
    pool = torch.randn(sum(need) + 4, layers, 2, P, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(pool.shape[0], generator=g).tolist()
    table = torch.zeros(len(ext), max(need), dtype=torch.int64)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    for p in perm:
        pool[p] = 1e4  # nobody's page: reading it would show
    q = torch.randn(sum(ext), heads, head_dim, generator=g)
    ext_t, pos0_t = torch.tensor(ext), torch.tensor(pos0)
    qstart = torch.cumsum(ext_t, 0) - ext_t
    assert cpu_native.extend_supported(heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    got = cpu_native.paged_extend(q, pool, 1, table, qstart, pos0_t, ext_t, window, scale, threads, dot)
    if not (dot and dtype == torch.bfloat16 and cpu_native.extend_dot_available()):
        want = _extend_reference(q, pool, 1, table, pos0_t, ext_t, window, scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
        return
    rounded = (q.double() * scale).to(torch.bfloat16).double() / scale
    want = _extend_reference(rounded, pool, 1, table, pos0_t, ext_t, window, scale)
    err = (got - want).norm() / want.norm()
    assert err < 2**-9, err
    torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)
    fp32_math = cpu_native.paged_extend(q, pool, 1, table, qstart, pos0_t, ext_t, window, scale, threads, False)
    assert not torch.equal(got, fp32_math)


def test_tiled_extend_shape_limits():
    assert not cpu_native.extend_supported(9, 3, 32)  # head_dim not 4 vectors
    assert not cpu_native.extend_supported(64, 1, 64)  # group over 48 rows
    assert cpu_native.extend_supported(48, 1, 64)
