"""Triton kernel bodies. Imported lazily (first Triton call), never by ``import engine``.

The bodies are plain functions; ``get_kernel(name, interpret)`` wraps them on first use with
``triton.jit`` (GPU) or the Triton interpreter (CPU tensors / ``TRITON_INTERPRET=1``). The
interpreter additionally needs ``TRITON_INTERPRET=1`` in the environment *before triton is
first imported*: triton.language's own helpers (``tl.sum``, ``tl.max``, ``tl.zeros``) are
``@jit`` functions bound to the mode active at that import. ``interpreter_usable()`` tells.
Helpers the bodies call (``_attend_block``) are wrapped at import by ``_device_fn`` in that
same mode, since a body finds them through this module's globals.
Every load/store is masked; slot, page and batch indices are cast to int64 before they are
multiplied by strides.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


def interpreter_usable() -> bool:
    """True when triton was imported in interpreter mode (``TRITON_INTERPRET=1`` set first)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def _store_kv_kernel(
    K_SRC,
    V_SRC,
    K_DST,
    V_DST,
    SLOTS,
    s_ks_t,
    s_ks_h,
    s_ks_d,
    s_vs_t,
    s_vs_h,
    s_vs_d,
    s_kd_p,
    s_kd_o,
    s_kd_h,
    s_kd_d,
    s_vd_p,
    s_vd_o,
    s_vd_h,
    s_vd_d,
    PAGE_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (n_tokens, cdiv(NUM_HEADS, BLOCK_H)); one token x BLOCK_H heads x all of head_dim.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    safe = tl.maximum(slot, 0)  # negative slot = padding, fully masked
    page = safe // PAGE_SIZE
    off = safe % PAGE_SIZE
    h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    n_heads = tl.where(slot >= 0, NUM_HEADS, 0)  # padding slot: no head is written
    mask = (h[:, None] < n_heads) & (d[None, :] < HEAD_DIM)

    k = tl.load(K_SRC + t * s_ks_t + h[:, None] * s_ks_h + d[None, :] * s_ks_d, mask=mask, other=0.0)
    v = tl.load(V_SRC + t * s_vs_t + h[:, None] * s_vs_h + d[None, :] * s_vs_d, mask=mask, other=0.0)
    k_ptr = K_DST + page * s_kd_p + off * s_kd_o + h[:, None] * s_kd_h + d[None, :] * s_kd_d
    v_ptr = V_DST + page * s_vd_p + off * s_vd_o + h[:, None] * s_vd_h + d[None, :] * s_vd_d
    tl.store(k_ptr, k.to(K_DST.dtype.element_ty), mask=mask)
    tl.store(v_ptr, v.to(V_DST.dtype.element_ty), mask=mask)


def _device_fn(fn):
    """Wrap a helper called from kernel bodies in the mode triton.language's helpers use.

    A kernel resolves a helper through this module's globals, so the helper cannot follow
    ``get_kernel``'s ``interpret`` flag; it follows the mode triton was imported in instead, which
    is the only mode whose ``tl.sum``/``tl.max`` work, hence the only one a kernel can run in.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn) if interpreter_usable() else triton.jit(fn)


@_device_fn
def _attend_block(
    q,
    k_ptrs,
    v_ptrs,
    t_mask,
    d_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    softcap,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """One key block of the online softmax; returns the updated ``(m_i, l_i, acc)``.

    ``k_ptrs``/``v_ptrs`` ``[BLOCK_N, D_PAD]``; ``t_mask`` ``[BLOCK_N]`` marks the valid keys (at
    least one, so the new running max is finite), ``d_mask`` ``[D_PAD]`` the real head dims.
    ``HAS_SOFTCAP``: ``qk_scale`` is the plain softmax scale and each score ``s`` becomes
    ``softcap * tanh(s / softcap)`` (tanh as ``2 / (1 + exp(-2x)) - 1``, exact at both ends), then
    is multiplied by log2(e) for exp2.
    """
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    s = s * qk_scale
    if HAS_SOFTCAP:
        s = (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0) * (softcap * 1.4426950408889634)
    s = tl.where(t_mask[None, :], s, float("-inf"))  # [G_PAD, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if USE_DOT:
        acc += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    else:
        acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc


def _paged_decode_kernel(
    Q,
    K,
    V,
    BT,
    SEQ,
    OUT,
    qk_scale,  # softmax scale * log2(e): scores are exponentiated with exp2 (HAS_SOFTCAP: the scale alone)
    softcap,  # attention logit soft cap (read when HAS_SOFTCAP)
    window,  # attend positions >= seq_len - window (huge when no window)
    s_qb,
    s_qh,
    s_qd,
    s_kp,
    s_ko,
    s_kh,
    s_kd,
    s_vp,
    s_vo,
    s_vh,
    s_vd,
    s_btb,
    s_btj,
    s_ob,
    s_oh,
    s_od,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr,  # GROUP padded (power of 2; >= 16 when USE_DOT)
    D_PAD: tl.constexpr,  # HEAD_DIM padded (power of 2; >= 16 when USE_DOT)
    BLOCK_N: tl.constexpr,  # keys per iteration
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # grid: (B, kv_heads); the program owns the GROUP query heads that share kv head `kvh`.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < HEAD_DIM
    qh = kvh * GROUP + g.to(tl.int64)
    gd_mask = (g < GROUP)[:, None] & d_mask[None, :]

    q = tl.load(Q + b * s_qb + qh[:, None] * s_qh + d[None, :] * s_qd, mask=gd_mask, other=0.0)
    seq_len = tl.load(SEQ + b).to(tl.int32)
    lo = tl.maximum(seq_len - window, 0)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    bt_row = BT + b * s_btb
    k_head = K + kvh * s_kh
    v_head = V + kvh * s_vh
    for start in range(lo, seq_len, BLOCK_N):  # lo <= start < seq_len: >= 1 valid key per block
        tok = start + n
        t_mask = tok < seq_len
        page = tl.load(bt_row + (tok // PAGE_SIZE).to(tl.int64) * s_btj, mask=t_mask, other=0).to(tl.int64)
        off = (tok % PAGE_SIZE).to(tl.int64)
        k_ptrs = k_head + page[:, None] * s_kp + off[:, None] * s_ko + d[None, :] * s_kd
        v_ptrs = v_head + page[:, None] * s_vp + off[:, None] * s_vo + d[None, :] * s_vd
        m_i, l_i, acc = _attend_block(
            q, k_ptrs, v_ptrs, t_mask, d_mask, m_i, l_i, acc, qk_scale, softcap, USE_DOT, DOT_PRECISION, HAS_SOFTCAP
        )

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # seq_len == 0 -> zero output
    out = acc / l_safe[:, None]
    tl.store(OUT + b * s_ob + qh[:, None] * s_oh + d[None, :] * s_od, out.to(OUT.dtype.element_ty), mask=gd_mask)


def _copy_pages_kernel(
    SRC,
    DST,
    PAGE_IDS,
    page_numel,
    s_src,
    s_dst,  # row strides (elements) of SRC and DST
    GATHER: tl.constexpr,  # True: SRC=pool (row page_ids[i]) -> DST row i; False: reverse
    BLOCK: tl.constexpr,
):
    # grid: (n, cdiv(page_numel, BLOCK))
    i = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    page = tl.load(PAGE_IDS + i).to(tl.int64)
    if GATHER:
        src_row = page
        dst_row = i
    else:
        src_row = i
        dst_row = page
    offs = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < page_numel
    x = tl.load(SRC + src_row * s_src + offs, mask=mask)
    tl.store(DST + dst_row * s_dst + offs, x, mask=mask)


_BODIES = {
    "store_kv": _store_kv_kernel,
    "paged_decode": _paged_decode_kernel,
    "copy_pages": _copy_pages_kernel,
}


def wrap(fn, interpret: bool):
    """Kernel body ``fn`` wrapped for the interpreter (``interpret=True``) or for compilation;
    RuntimeError when the interpreter is asked for but triton was imported without
    ``TRITON_INTERPRET=1``."""
    if interpret:
        if not interpreter_usable():
            raise RuntimeError(
                "Triton kernels on CPU tensors run in the Triton interpreter, which needs "
                "TRITON_INTERPRET=1 set before triton is first imported in this process"
            )
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


@functools.cache
def get_kernel(name: str, interpret: bool):
    """The kernel ``name`` wrapped for the interpreter (``interpret=True``) or for compilation."""
    return wrap(_BODIES[name], interpret)
