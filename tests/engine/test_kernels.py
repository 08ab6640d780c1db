"""KV kernels: Triton (run on CPU by the Triton interpreter) against the torch reference, and the
torch reference against dense ``scaled_dot_product_attention``.

``TRITON_INTERPRET`` must be set before triton is first imported in the process, hence the very
first statement. If another module imported triton earlier without it, the Triton tests skip.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cache.kv_pool import KVPool  # noqa: E402
from engine.kernels import (  # noqa: E402
    gather_pages,
    paged_decode_attention,
    paged_decode_attention_torch,
    resolve_backend,
    scatter_pages,
    store_kv,
    triton_available,
)
from tests.support.triton_interpreter import needs_triton  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYER = 1  # a middle layer of a 2-layer pool: the layer views are strided and offset


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


# ---------------------------------------------------------------------------------------------
# fixtures


def make_decode_case(seq_lens, page_size, kv_heads, group, head_dim, dtype, seed=0):
    """A filled 2-layer pool, shuffled (non-contiguous) pages per request, and q.

    Block-table entries past each request's pages hold an out-of-range page id: they must
    never be read.
    """
    gen = torch.Generator().manual_seed(seed)
    n_pages = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(n_pages) + 3
    pool = KVPool(num_pages, 2, page_size, kv_heads, head_dim, dtype=dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    perm = torch.randperm(num_pages, generator=gen)
    max_pages = max(n_pages) + 1
    block_table = torch.full((len(seq_lens), max_pages), 10**6, dtype=torch.long)
    used = 0
    for i, n in enumerate(n_pages):
        block_table[i, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return pool, block_table, torch.tensor(seq_lens, dtype=torch.long), q


def dense_decode(q, pool, layer, block_table, seq_lens, scale, window):
    """Per request: gather contiguous K/V through the block table, then dense SDPA (fp64)."""
    P = pool.page_size
    group = q.shape[1] // pool.num_kv_heads
    outs = []
    for i, L in enumerate(seq_lens.tolist()):
        pages = block_table[i, : math.ceil(L / P)]
        k = pool.k_layer(layer)[pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:L]
        v = pool.v_layer(layer)[pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:L]
        if window is not None:
            k, v = k[max(0, L - window) :], v[max(0, L - window) :]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[i].double().unsqueeze(1)  # [H, 1, D]
        outs.append(F.scaled_dot_product_attention(qi, k, v, scale=scale).squeeze(1))
    return torch.stack(outs)


SEQ_LENS = [1, 37, 16, 23]  # includes 1, multiples and non-multiples of every page size


# ---------------------------------------------------------------------------------------------
# the oracle itself


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_decode_matches_dense_sdpa(page_size, kv_heads, group, window):
    pool, bt, sl, q = make_decode_case(SEQ_LENS, page_size, kv_heads, group, 64, torch.float32)
    scale = 64**-0.5
    got = paged_decode_attention_torch(q, pool.k_layer(LAYER), pool.v_layer(LAYER), bt, sl, scale, page_size, window)
    want = dense_decode(q, pool, LAYER, bt, sl, scale, window)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_reference_decode_fp16_and_window_edges():
    pool, bt, sl, q = make_decode_case([3, 9], 4, 2, 2, 32, torch.float16)
    for window in (1, 9, 100):
        got = paged_decode_attention_torch(q, pool.k_layer(0), pool.v_layer(0), bt, sl, 0.3, 4, window)
        want = dense_decode(q, pool, 0, bt, sl, 0.3, window)
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
    # window=1: the output is the last token's V (per kv head)
    got = paged_decode_attention_torch(q, pool.k_layer(0), pool.v_layer(0), bt, sl, 0.3, 4, 1)
    last = pool.v_layer(0)[bt[1, 2], 0]  # token 8 of request 1
    torch.testing.assert_close(got[1], last.repeat_interleave(2, dim=0))


def test_auto_backend_is_torch_on_cpu_and_validates():
    x = torch.zeros(2)
    assert resolve_backend(None, x) == "torch"
    assert resolve_backend("auto", x) == "torch"
    assert resolve_backend("torch", x) == "torch"
    with pytest.raises(ValueError):
        resolve_backend("cuda", x)
    pool, bt, sl, q = make_decode_case([5], 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(q, pool.k_layer(0), pool.v_layer(0), bt, sl, 1.0, 4, sliding_window=0)
    with pytest.raises(ValueError):
        paged_decode_attention(q[:, :3], pool.k_layer(0), pool.v_layer(0), bt, sl, 1.0, 4)


@pytest.mark.process  # a fresh interpreter
def test_import_engine_does_not_import_triton():
    code = "import sys, engine.kernels, engine.attention; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


# ---------------------------------------------------------------------------------------------
# store_kv


def _store_case(page_size, dtype, n=11, kv_heads=3, head_dim=64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(12, 2, page_size, kv_heads, head_dim, dtype=dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    slots = torch.randperm(pool.num_slots, generator=gen)[:n]
    kv = torch.randn(n, 2, kv_heads, head_dim, generator=gen)  # k, v: strided slices
    return pool, slots, kv[:, 0], kv[:, 1]


def _check_stored(pool, before, slots, k, v, layer):
    P = pool.page_size
    expect = before.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // P, layer, 0, s % P] = k[i].to(pool.dtype)
            expect[s // P, layer, 1, s % P] = v[i].to(pool.dtype)
    torch.testing.assert_close(pool.buffer, expect, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv(backend, page_size, dtype):
    pool, slots, k, v = _store_case(page_size, dtype)
    assert not pool.k_layer(LAYER).is_contiguous() and not k.is_contiguous()
    before = pool.buffer.clone()
    store_kv(pool.k_layer(LAYER), pool.v_layer(LAYER), slots, k, v, backend=backend)
    _check_stored(pool, before, slots, k, v, LAYER)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_store_kv_skips_negative_padding_slots(backend):
    pool, slots, k, v = _store_case(4, torch.float32, n=5)
    slots = slots.clone()
    slots[1] = -1
    slots[4] = -1
    before = pool.buffer.clone()
    store_kv(pool.k_layer(0), pool.v_layer(0), slots.to(torch.int32), k, v, backend=backend)
    _check_stored(pool, before, slots, k, v, 0)


# ---------------------------------------------------------------------------------------------
# paged decode attention, Triton vs reference


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_triton_matches_reference(dtype, page_size, kv_heads, group, window):
    pool, bt, sl, q = make_decode_case(SEQ_LENS, page_size, kv_heads, group, 64, dtype)
    scale = 64**-0.5
    args = (q, pool.k_layer(LAYER), pool.v_layer(LAYER), bt, sl, scale, page_size, window)
    # block_n=16: several key blocks per request, and window starts not aligned to blocks/pages
    got = paged_decode_attention(*args, backend="triton", block_n=16)
    want = paged_decode_attention_torch(*args)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **_tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 4)])
@pytest.mark.parametrize("use_dot", [True, None])
def test_decode_triton_dot_and_default_paths(dtype, kv_heads, group, use_dot):
    """tl.dot over the (padded) query-head group, and the default tile choice."""
    pool, bt, sl, q = make_decode_case(SEQ_LENS, 4, kv_heads, group, 64, dtype, seed=2)
    args = (q, pool.k_layer(LAYER), pool.v_layer(LAYER), bt, sl, 0.125, 4, 7)
    got = paged_decode_attention(*args, backend="triton", use_dot=use_dot)
    want = paged_decode_attention_torch(*args)
    torch.testing.assert_close(got, want, **_tol(dtype))


@needs_triton
@pytest.mark.parametrize("use_dot", [False, True])
def test_decode_triton_odd_head_dim_strided_q(use_dot):
    """head_dim 24 (padded to 32 in the kernel) and a non-contiguous q."""
    pool, bt, sl, q = make_decode_case([2, 13, 9], 4, 1, 5, 24, torch.float32, seed=3)
    q_big = torch.zeros(q.shape[0], q.shape[1], 40)
    q_big[..., :24] = q
    q = q_big[..., :24]
    assert not q.is_contiguous()
    args = (q, pool.k_layer(0), pool.v_layer(0), bt, sl, 0.2, 4)
    got = paged_decode_attention(*args, backend="triton", use_dot=use_dot, block_n=16)
    torch.testing.assert_close(got, paged_decode_attention_torch(*args), **_tol(torch.float32))


def dense_capped_decode(q, pool, layer, block_table, seq_lens, scale, window, cap):
    """``dense_decode`` with Gemma 2's soft cap on the scores (fp64, written out: SDPA cannot cap)."""
    P, group, outs = pool.page_size, q.shape[1] // pool.num_kv_heads, []
    for i, L in enumerate(seq_lens.tolist()):
        pages = block_table[i, : math.ceil(L / P)]
        k = pool.k_layer(layer)[pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:L]
        v = pool.v_layer(layer)[pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:L]
        if window is not None:
            k, v = k[max(0, L - window) :], v[max(0, L - window) :]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hld->hl", q[i].double(), k) * scale
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(torch.tanh(s / cap) * cap, -1), v))
    return torch.stack(outs)


@pytest.mark.parametrize("window", [None, 5])
def test_reference_decode_soft_cap_matches_dense(window):
    pool, bt, sl, q = make_decode_case(SEQ_LENS, 4, 2, 3, 32, torch.float32, seed=4)
    args = (q * 4, pool.k_layer(LAYER), pool.v_layer(LAYER), bt, sl, 0.5, 4, window)
    got = paged_decode_attention_torch(*args, softcap=2.0)
    want = dense_capped_decode(q * 4, pool, LAYER, bt, sl, 0.5, window, 2.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # the cap acts on these scores: without it the output is another
    assert (paged_decode_attention_torch(*args) - got).abs().max() > 0.05


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_triton_soft_cap_matches_reference(dtype, use_dot, window):
    """Gemma 2's attention soft cap in the Triton decode kernel (interpreter), on scores large
    enough that the cap changes the output."""
    pool, bt, sl, q = make_decode_case(SEQ_LENS, 4, 2, 4, 32, dtype, seed=5)
    args = (q * 4, pool.k_layer(LAYER), pool.v_layer(LAYER), bt, sl, 0.5, 4, window)
    got = paged_decode_attention(*args, softcap=2.0, backend="triton", use_dot=use_dot, block_n=16)
    want = paged_decode_attention_torch(*args, softcap=2.0)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert (paged_decode_attention_torch(*args) - want).abs().max() > 0.05


@needs_triton
def test_decode_triton_zero_length_request_gives_zeros():
    pool, bt, sl, q = make_decode_case([5, 3], 4, 2, 2, 16, torch.float32)
    sl = torch.tensor([5, 0])
    args = (q, pool.k_layer(0), pool.v_layer(0), bt, sl, 0.25, 4)
    got = paged_decode_attention(*args, backend="triton")
    want = paged_decode_attention_torch(*args)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got, want, **_tol(torch.float32))


# ---------------------------------------------------------------------------------------------
# gather / scatter pages


def _page_buffer(strided: bool, dtype=torch.float32):
    """A ``KVPool.buffer``-shaped tensor; ``strided`` leaves a gap between pages."""
    shape = (7, 2, 2, 4, 2, 8)
    numel = math.prod(shape[1:])
    base = torch.randn(shape[0], numel + (5 if strided else 0)).to(dtype)
    return base[:, :numel].unflatten(1, shape[1:])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_scatter_pages_round_trip(backend, strided, dtype):
    buf = _page_buffer(strided, dtype)
    ids = torch.tensor([5, 0, 3])
    staged = gather_pages(buf, ids, backend=backend)
    assert staged.shape == (3, buf[0].numel()) and staged.is_contiguous()
    assert torch.equal(staged, buf[ids].reshape(3, -1))

    dst = torch.zeros_like(_page_buffer(strided, dtype))
    scatter_pages(dst, [6, 1, 2], staged, backend=backend)
    assert torch.equal(dst[[6, 1, 2]], buf[ids])
    assert torch.equal(dst[[0, 3, 4, 5]], torch.zeros_like(dst[[0, 3, 4, 5]]))

    out = torch.empty_like(staged)
    assert gather_pages(dst, [6, 1, 2], out=out, backend=backend) is out
    assert torch.equal(out, staged)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gather_pages_of_kv_pool(backend):
    pool = KVPool(5, 3, 4, 2, 8)
    pool.buffer.normal_()
    staged = gather_pages(pool.buffer, [4, 2], backend=backend)
    assert staged.shape == (2, pool.page_bytes // pool.buffer.element_size())
    fresh = KVPool(5, 3, 4, 2, 8)
    scatter_pages(fresh.buffer, [0, 1], staged, backend=backend)
    assert torch.equal(fresh.k_layer(2)[0], pool.k_layer(2)[4])
    assert torch.equal(fresh.v_layer(1)[1], pool.v_layer(1)[2])
    with pytest.raises(ValueError):
        scatter_pages(fresh.buffer, [0, 1], staged.half(), backend=backend)


# ---------------------------------------------------------------------------------------------
# GPU compile check without a GPU: the interpreter accepts some programs the compiler rejects.

_COMPILE_SCRIPT = r"""
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.kernels import _triton_kernels as tk

def compile_sm90(name, ptrs, consts):
    fn = tk.get_kernel(name, False)
    params = inspect.signature(tk._BODIES[name]).parameters
    sig = {p: ("constexpr" if p in consts else ptrs.get(p, "i32")) for p in params}
    sig.update({p: "fp32" for p in params if p in ("qk_scale", "softcap")})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

h = "*fp16"
compile_sm90("store_kv", dict(K_SRC="*bf16", V_SRC="*bf16", K_DST=h, V_DST=h, SLOTS="*i64"),
             dict(PAGE_SIZE=16, NUM_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
dec = dict(Q=h, K=h, V=h, BT="*i32", SEQ="*i64", OUT=h)
compile_sm90("paged_decode", dec, dict(PAGE_SIZE=16, GROUP=7, HEAD_DIM=96, G_PAD=16, D_PAD=128,
                                       BLOCK_N=64, USE_DOT=True, DOT_PRECISION=None, HAS_SOFTCAP=False))
compile_sm90("paged_decode", dec, dict(PAGE_SIZE=1, GROUP=3, HEAD_DIM=64, G_PAD=4, D_PAD=64,
                                       BLOCK_N=32, USE_DOT=False, DOT_PRECISION=None, HAS_SOFTCAP=False))
compile_sm90("paged_decode", dec, dict(PAGE_SIZE=16, GROUP=2, HEAD_DIM=256, G_PAD=16, D_PAD=256,
                                       BLOCK_N=32, USE_DOT=True, DOT_PRECISION=None, HAS_SOFTCAP=True))
compile_sm90("copy_pages", dict(SRC=h, DST=h, PAGE_IDS="*i64"), dict(GATHER=False, BLOCK=2048))
print("compiled")
"""


@pytest.mark.process  # a fresh interpreter compiles the kernels
@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_kernels_compile_for_sm90_without_gpu():
    """AOT-compile representative configurations to sm_90 cubin (ptxas bundled with triton)."""
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], cwd=REPO, env=env, timeout=300, capture_output=True, text=True
    )
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
