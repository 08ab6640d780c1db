"""Paged decode attention (one query token per request) over the page-major KV pool."""

from __future__ import annotations

import math

import torch

from engine.kernels._dispatch import next_pow2, resolve_backend, use_interpreter
from engine.kernels.reference import paged_decode_attention_torch

_NO_WINDOW = 2**31 - 1
_ELEMWISE_TILE = 8192  # max G_PAD * BLOCK_N * D_PAD of the elementwise path's 3-D product


def _block_n(use_dot: bool, g_pad: int, d_pad: int) -> int:
    if use_dot:
        return 64 if d_pad <= 128 else 32
    return max(16, min(64, _ELEMWISE_TILE // (g_pad * d_pad)))


def _check_shapes(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sliding_window: int | None,
) -> None:
    """Validate the arguments of ``paged_decode_attention``: ValueError naming the mismatch."""
    B, num_heads, head_dim = q.shape
    if k_layer.dim() != 4 or k_layer.shape[1] != page_size or k_layer.shape[3] != head_dim:
        raise ValueError(f"k_layer {tuple(k_layer.shape)} does not match page_size {page_size}, head_dim {head_dim}")
    if v_layer.shape != k_layer.shape:
        raise ValueError(f"v_layer {tuple(v_layer.shape)} differs from k_layer {tuple(k_layer.shape)}")
    kv_heads = k_layer.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(
            f"block_table {tuple(block_table.shape)} / seq_lens {tuple(seq_lens.shape)} do not match batch {B}"
        )


def _tiling(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    group: int,
    head_dim: int,
    use_dot: bool | None,
    block_n: int | None,
) -> tuple[bool, int, int, int]:
    """Triton tile choice ``(use_dot, g_pad, d_pad, block_n)``; ``None`` knobs get the defaults.

    Raises ValueError for a ``block_n`` that is not a power of 2 (or < 16 with ``use_dot``), and
    for ``use_dot`` with a pool dtype other than q's.
    """
    if use_dot is None:
        use_dot = q_dtype in (torch.float16, torch.bfloat16) and kv_dtype == q_dtype and group >= 4
    g_pad = next_pow2(group)
    d_pad = next_pow2(head_dim)
    if use_dot:  # tl.dot needs every dimension >= 16
        g_pad, d_pad = max(g_pad, 16), max(d_pad, 16)
    if block_n is None:
        block_n = _block_n(use_dot, g_pad, d_pad)
    if block_n & (block_n - 1) or (use_dot and block_n < 16):
        raise ValueError(f"block_n must be a power of 2 (>= 16 with use_dot), got {block_n}")
    if use_dot and kv_dtype != q_dtype:
        raise ValueError(f"use_dot needs q and the KV pool in one dtype, got {q_dtype} / {kv_dtype}")
    return use_dot, g_pad, d_pad, block_n


def paged_decode_attention(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    backend: str | None = None,
    use_dot: bool | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Decode attention of one query per request over paged K/V; returns ``[B, num_heads, head_dim]``.

    Shapes/dtypes:
    - ``q``: ``[B, num_heads, head_dim]`` (any strides), fp32/fp16/bf16.
    - ``k_layer``/``v_layer``: ``[num_pages, page_size, kv_heads, head_dim]`` strided views of
      the pool (``KVPool.k_layer(l)``); ``num_heads % kv_heads == 0`` (GQA: query head ``h``
      reads kv head ``h // (num_heads // kv_heads)``); ``head_dim <= 256``, any value.
    - ``block_table``: int ``[B, max_pages]``; ``[i, j]`` is the page holding tokens
      ``[j*page_size, (j+1)*page_size)`` of request i. Only columns
      ``< ceil(seq_lens[i] / page_size)`` are read.
    - ``seq_lens``: int ``[B]``, keys per request (including the current token, whose K/V must
      already be stored). ``seq_lens[i] == 0`` yields a zero output row.
    - ``sliding_window=W``: only positions ``>= seq_lens[i] - W`` are attended (the last W
      tokens); ``None`` = full attention.
    - ``softcap=C``: each scaled score ``s`` becomes ``C * tanh(s / C)`` before the mask (Gemma 2's
      attention logit soft-capping); ``None`` = none.
    Scores, softmax (online, over key blocks) and the weighted sum are fp32; the output is
    a new contiguous tensor with q's dtype and device.

    ``backend``: ``None``/``"auto"`` (Triton iff all tensors are on CUDA), ``"torch"``,
    ``"triton"`` (on CPU tensors this runs the Triton interpreter). Triton-only tuning knobs:
    ``use_dot`` (tensor-core ``tl.dot`` over the query-head group, default: fp16/bf16 with a
    group of >= 4 heads and a pool of q's dtype) and ``block_n`` (keys per iteration, power of 2).
    """
    _check_shapes(q, k_layer, v_layer, block_table, seq_lens, page_size, sliding_window)
    if resolve_backend(backend, q, k_layer, v_layer, block_table, seq_lens) == "torch":
        return paged_decode_attention_torch(
            q, k_layer, v_layer, block_table, seq_lens, scale, page_size, sliding_window, softcap
        )
    return _paged_decode_triton(
        q, k_layer, v_layer, block_table, seq_lens, scale, page_size, sliding_window, use_dot, block_n, softcap
    )


def _paged_decode_triton(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int | None,
    use_dot: bool | None,
    block_n: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The Triton path of ``paged_decode_attention`` on arguments ``_check_shapes`` accepted."""
    from engine.kernels._triton_kernels import get_kernel

    B, num_heads, head_dim = q.shape
    out = torch.empty((B, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    kv_heads = k_layer.shape[2]
    group = num_heads // kv_heads
    use_dot, g_pad, d_pad, block_n = _tiling(q.dtype, k_layer.dtype, group, head_dim, use_dot, block_n)
    interpret = use_interpreter(q, k_layer, v_layer, block_table, seq_lens)
    kernel = get_kernel("paged_decode", interpret)
    window = _NO_WINDOW if sliding_window is None else int(sliding_window)
    kernel[(B, kv_heads)](
        q,
        k_layer,
        v_layer,
        block_table,
        seq_lens,
        out,
        float(scale) if softcap else float(scale) * math.log2(math.e),
        float(softcap or 0.0),
        window,
        *q.stride(),
        *k_layer.stride(),
        *v_layer.stride(),
        *block_table.stride(),
        *out.stride(),
        PAGE_SIZE=page_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        G_PAD=g_pad,
        D_PAD=d_pad,
        BLOCK_N=block_n,
        USE_DOT=use_dot,
        # fp32 dots in full precision (not TF32); fp16/bf16 use the target's default
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        HAS_SOFTCAP=bool(softcap),
    )
    return out
