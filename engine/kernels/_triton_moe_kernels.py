"""Triton bodies of the fused-MoE kernels. Imported lazily (first Triton MoE call), never by ``import engine``.

Both kernels walk the same layout, built on the host by ``engine.kernels.triton_moe.align``: the
step's (token, slot) pairs sorted by expert, each expert's group padded to a multiple of ``BLOCK_M``
with the sentinel ``num_pairs``, and one expert id per block of ``BLOCK_M`` sorted positions (-1 for
the blocks past the last group, which hold only padding: they run no iteration and store nothing,
their rows being masked as padding). A program owns one such block and ``BLOCK_N`` output columns, so
every program multiplies rows of a single expert: a grouped GEMM whose weights are read once per
block. Products accumulate in float32; pair, token and expert indices are cast to int64 before they
are multiplied by strides; every load and store is masked (padding rows and columns past the
matrix read 0 and write nothing). Int8 weights (``HAS_SCALE``) are widened to the activations'
dtype, exact for |q| <= 127, and each output column is multiplied by its row's scale after the sum.
The accumulators start as ``tl.full``, not ``tl.zeros``: the interpreter re-patches triton.language
on every call of a ``@jit`` helper like ``tl.zeros``, a third of a small program's time there.
"""

from __future__ import annotations

import functools

import triton.language as tl

from engine.kernels._triton_kernels import wrap


def _gate_up_kernel(
    X,  # [tokens, hidden]
    W,  # [experts, 2 * inter, hidden]: gate rows, then up rows
    W_SCALE,  # [experts, 2 * inter] float32 (read when HAS_SCALE)
    ACT,  # [padded positions, inter]: SiLU(gate) * up per sorted position
    SORTED,  # [padded positions] pair id (token * TOP_K + slot), num_pairs = padding
    BLOCK_EXPERT,  # [blocks] expert of each block, -1 = unused block
    num_pairs,
    hidden,
    inter,
    s_xt,
    s_xh,
    s_we,
    s_wn,
    s_wk,
    s_se,
    s_sn,
    s_ap,
    s_ai,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the operands of tl.dot: the activations' dtype (see dot_dtype)
):
    # grid: (blocks, cdiv(inter, BLOCK_N)); columns n of the gate and the same n of the up half.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    e = tl.maximum(expert, 0)
    k_end = tl.where(expert >= 0, hidden, 0)  # an unused block runs no iteration and stores nothing
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    pair = tl.load(SORTED + pos).to(tl.int64)
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // TOP_K, 0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_ok = n < inter
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    x_ptrs = X + token[:, None] * s_xt + k[None, :] * s_xh
    g_ptrs = W + e * s_we + n[None, :] * s_wn + k[:, None] * s_wk  # [BLOCK_K, BLOCK_N], transposed view
    u_ptrs = g_ptrs + inter * s_wn
    acc_g = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = k + k0 < hidden
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0).to(DOT_DTYPE)
        wu = tl.load(u_ptrs, mask=w_mask, other=0).to(DOT_DTYPE)
        acc_g += tl.dot(a, wg, input_precision=DOT_PRECISION)
        acc_u += tl.dot(a, wu, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * s_xh
        g_ptrs += BLOCK_K * s_wk
        u_ptrs += BLOCK_K * s_wk
    if HAS_SCALE:
        acc_g *= tl.load(W_SCALE + e * s_se + n * s_sn, mask=n_ok, other=0.0)[None, :]
        acc_u *= tl.load(W_SCALE + e * s_se + (n + inter) * s_sn, mask=n_ok, other=0.0)[None, :]
    # gate and up are rounded to the activations' dtype first, as the torch path's matmul output is
    g = acc_g.to(ACT.dtype.element_ty).to(tl.float32)
    u = acc_u.to(ACT.dtype.element_ty).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u
    a_ptrs = ACT + pos[:, None] * s_ap + n[None, :] * s_ai
    tl.store(a_ptrs, act.to(ACT.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _down_kernel(
    ACT,  # [padded positions, inter]
    W,  # [experts, hidden, inter]
    W_SCALE,  # [experts, hidden] float32 (read when HAS_SCALE)
    PAIR_W,  # [num_pairs] float32 routing weight of each pair
    OUT,  # [num_pairs, hidden] float32: weight * expert output per pair
    SORTED,
    BLOCK_EXPERT,
    num_pairs,
    hidden,
    inter,
    s_ap,
    s_ai,
    s_we,
    s_wn,
    s_wk,
    s_se,
    s_sn,
    s_op,
    s_oh,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the operands of tl.dot: the activations' dtype (see dot_dtype)
):
    # grid: (blocks, cdiv(hidden, BLOCK_N)); every pair row is written by exactly one program column.
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    e = tl.maximum(expert, 0)
    k_end = tl.where(expert >= 0, inter, 0)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    pair = tl.load(SORTED + pos).to(tl.int64)
    row_ok = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_ok = n < hidden
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = ACT + pos[:, None] * s_ap + k[None, :] * s_ai
    w_ptrs = W + e * s_we + n[None, :] * s_wn + k[:, None] * s_wk
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = k + k0 < inter
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0).to(DOT_DTYPE)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * s_ai
        w_ptrs += BLOCK_K * s_wk
    if HAS_SCALE:
        acc *= tl.load(W_SCALE + e * s_se + n * s_sn, mask=n_ok, other=0.0)[None, :]
    # the expert output is rounded to the activations' dtype before the weighting, as on the torch path
    y = acc.to(ACT.dtype.element_ty).to(tl.float32)
    weight = tl.load(PAIR_W + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0)
    o_ptrs = OUT + tl.where(row_ok, pair, 0)[:, None] * s_op + n[None, :] * s_oh
    tl.store(o_ptrs, y * weight[:, None], mask=row_ok[:, None] & n_ok[None, :])


def dot_dtype(name: str, interpret: bool):
    """The ``DOT_DTYPE`` of activations of torch dtype ``name`` (``"bfloat16"``, ...): their own
    dtype, except bfloat16 in the interpreter, float32 there. The interpreter's ``tl.dot`` multiplies
    bfloat16's raw bits (it stores them as uint16), so it gets the widened values, whose products
    are the same exact float32 products a bfloat16 ``tl.dot`` accumulates on the GPU."""
    if interpret and name == "bfloat16":
        return tl.float32
    return {"float32": tl.float32, "float16": tl.float16, "bfloat16": tl.bfloat16}[name]


_BODIES = {"gate_up": _gate_up_kernel, "down": _down_kernel}


@functools.cache
def get_kernel(name: str, interpret: bool):
    """The MoE kernel ``name`` (``gate_up`` or ``down``) wrapped for the interpreter (``interpret``)
    or for compilation (``engine.kernels._triton_kernels.wrap``)."""
    return wrap(_BODIES[name], interpret)
