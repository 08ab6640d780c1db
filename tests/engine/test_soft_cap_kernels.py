"""Gemma 2's attention logit soft cap (scores ``cap * tanh(s / cap)`` before the mask) in the C CPU
kernels: the paged decode kernel (scalar, vector and bfloat16-product paths) and the tiled extend
kernel against float64 dense attention, on scores large enough that the cap changes the output.
The Triton kernel's cap is tested in tests/engine/test_kernels.py (interpreter)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_native

pytestmark = [pytest.mark.unit, pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler")]

CAP, P, LAYER = 2.0, 16, 1


def _pool(pages: int, kv_heads: int, head_dim: int, dtype, g) -> torch.Tensor:
    return torch.randn(pages, 2, 2, P, kv_heads, head_dim, generator=g).to(dtype)


def _dense(q, k, v, scale: float, mask, cap: float | None) -> torch.Tensor:
    """float64 attention ``[H, n, D]`` x ``[Hkv, s, D]`` with the cap (None: none) and a ``[n, s]`` mask."""
    g = q.shape[0] // k.shape[0]
    s = torch.einsum("hnd,hsd->hns", q.double(), k.double().repeat_interleave(g, 0)) * scale
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hns,hsd->hnd", s.softmax(-1), v.double().repeat_interleave(g, 0))


def _keys(pool, table_row, n: int):
    kv_heads, head_dim = pool.shape[4:]
    pages = table_row[: -(-n // P)]
    k = pool[pages, LAYER, 0].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)
    v = pool[pages, LAYER, 1].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(2, 8), (3, 64), (12, 32)])  # 8: scalar path; 12: any-group path
@pytest.mark.parametrize("dot", [False, True])
def test_decode_kernel_soft_caps_the_scores(dtype, group, head_dim, dot):
    g = torch.Generator().manual_seed(group * 100 + head_dim)
    kv_heads, pages = 2, 40
    pool = _pool(pages, kv_heads, head_dim, dtype, g)
    spans = [(0, 300), (5, 6), (3, 70), (0, 1), (17, 130)]
    order = torch.randperm(pages, generator=g).tolist()
    table = torch.zeros(len(spans), 20, dtype=torch.int64)
    for i, (_, hi_) in enumerate(spans):
        table[i, : -(-hi_ // P)] = torch.tensor([order.pop() for _ in range(-(-hi_ // P))])
    for p in order:
        pool[p] = 1e4  # nobody's page: reading it would show
    lo, hi = torch.tensor([a for a, _ in spans]), torch.tensor([b for _, b in spans])
    q = (torch.randn(len(spans), kv_heads * group, head_dim, generator=g) * 4).to(dtype)
    scale = head_dim**-0.5
    got = cpu_native.paged_decode(q, pool, LAYER, table, lo, hi, scale, 2, dot=dot, softcap=CAP)
    plain = cpu_native.paged_decode(q, pool, LAYER, table, lo, hi, scale, 2, dot=dot)
    products_bf16 = dot and dtype == torch.bfloat16 and head_dim >= 32 and cpu_native.decode_dot_available()
    tol = 2e-2 if products_bf16 else 1e-5
    for i, (a, b) in enumerate(spans):
        k, v = _keys(pool, table[i], b)
        mask = torch.ones(1, b - a, dtype=torch.bool)
        want = _dense(q[i].unsqueeze(1), k[:, a:], v[:, a:], scale, mask, CAP).squeeze(1)
        torch.testing.assert_close(got[i].double(), want, rtol=tol, atol=tol)
    assert (got - plain).abs().max() > 0.05  # the cap acts on these scores


@pytest.mark.parametrize("dtype,dot", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 2, 64, None), (4, 1, 256, 40), (6, 1, 128, 7)])
def test_tiled_extend_kernel_soft_caps_before_the_mask(dtype, dot, heads, kv_heads, head_dim, window):
    """Requests with and without a cached prefix, a one-token chunk, a window shorter than the prompt."""
    g = torch.Generator().manual_seed(heads * 10 + head_dim)
    pos0, ext = [0, 60, 3], [100, 37, 1]
    need = [-(-(p + n) // P) for p, n in zip(pos0, ext)]
    pool = _pool(sum(need) + 3, kv_heads, head_dim, dtype, g)
    perm = torch.randperm(pool.shape[0], generator=g).tolist()
    table = torch.zeros(len(ext), max(need), dtype=torch.int64)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)])
    for p in perm:
        pool[p] = 1e4
    q = torch.randn(sum(ext), heads, head_dim, generator=g) * 4
    ext_t, pos0_t = torch.tensor(ext), torch.tensor(pos0)
    qstart = torch.cumsum(ext_t, 0) - ext_t
    scale = head_dim**-0.5
    args = (q, pool, LAYER, table, qstart, pos0_t, ext_t, window, scale, 2, dot)
    got, plain = cpu_native.paged_extend(*args, softcap=CAP), cpu_native.paged_extend(*args)
    products_bf16 = dot and dtype == torch.bfloat16 and cpu_native.extend_dot_available()
    tol = 3e-2 if products_bf16 else 2e-5
    row = 0
    for b, (p0, n) in enumerate(zip(pos0, ext)):
        k, v = _keys(pool, table[b], p0 + n)
        qpos, kpos = torch.arange(p0, p0 + n)[:, None], torch.arange(p0 + n)[None]
        mask = (kpos <= qpos) if window is None else (kpos <= qpos) & (kpos > qpos - window)
        want = _dense(q[row : row + n].transpose(0, 1), k, v, scale, mask, CAP).transpose(0, 1)
        torch.testing.assert_close(got[row : row + n].double(), want, rtol=tol, atol=tol)
        row += n
    assert (got - plain).abs().max() > 0.05
