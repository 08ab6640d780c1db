"""Pure-torch implementations of the KV kernels.

These are the CPU path of the dispatchers in this package and the oracle the Triton kernels are
tested against. They follow the page-major pool layout of ``cache/kv_pool.py``: a layer view
``[num_pages, page_size, kv_heads, head_dim]`` (strided, not contiguous) and flat slots
``s = page * page_size + offset``.
"""

from __future__ import annotations

import math

import torch


def store_kv_torch(
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write ``k``/``v`` into the layer views at flat ``slots`` (in place).

    Shapes: ``k_layer``/``v_layer`` ``[num_pages, page_size, kv_heads, head_dim]`` (any strides,
    e.g. ``KVPool.k_layer(l)``); ``slots`` int ``[n]``; ``k``/``v`` ``[n, kv_heads, head_dim]``,
    any float dtype (cast to the pool dtype). Invariants: ``slots`` unique; each slot is either
    ``< num_pages * page_size`` or negative (negative slots are padding and are skipped).
    """
    page_size = k_layer.shape[1]
    slots = slots.to(device=k_layer.device, dtype=torch.long)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    pages = torch.div(slots, page_size, rounding_mode="floor")
    offsets = slots % page_size
    k_layer[pages, offsets] = k.to(k_layer.dtype)
    v_layer[pages, offsets] = v.to(v_layer.dtype)


def _key_slots(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sliding_window: int | None,
    max_len: int,
    batch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, pages, offsets)``, each ``[batch, max_len]``, for key positions ``0..max_len-1``.

    ``valid`` marks the positions request i attends; ``pages``/``offsets`` locate each position in
    the pool, with page 0 where ``valid`` is False so that junk block-table entries are never read.
    ``seq_lens`` is a long tensor on the device of the result.
    """
    device = seq_lens.device
    pos = torch.arange(max_len, device=device)  # [L]
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if sliding_window is not None:
        valid &= pos[None, :] >= (seq_lens[:, None] - sliding_window)
    cols = torch.div(pos, page_size, rounding_mode="floor")
    cols = cols.clamp(max=block_table.shape[1] - 1)
    pages = block_table.to(device=device, dtype=torch.long)[:, cols]  # [B, L]
    pages = torch.where(valid, pages, torch.zeros_like(pages))  # never read junk entries
    offsets = (pos % page_size)[None, :].expand(batch, -1)
    return valid, pages, offsets


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Single-query (decode) attention over paged K/V; returns ``[B, num_heads, head_dim]``.

    Shapes: ``q`` ``[B, num_heads, head_dim]``; ``k_layer``/``v_layer``
    ``[num_pages, page_size, kv_heads, head_dim]`` (any strides); ``block_table`` int
    ``[B, max_pages]`` (entry ``[i, j]`` is the page of tokens ``[j*P, (j+1)*P)`` of request i,
    entries past the request's last page are never read); ``seq_lens`` int ``[B]``.
    GQA: ``num_heads % kv_heads == 0``; query head ``h`` uses kv head ``h // (num_heads//kv_heads)``.
    Request i attends its key positions ``j`` with ``j < seq_lens[i]`` and, when
    ``sliding_window=W`` is given, ``j >= seq_lens[i] - W``. Scores/softmax/accumulation are
    fp32; output has q's dtype. A request with ``seq_lens[i] == 0`` gets a zero output.
    ``softcap=C``: scores become ``C * tanh(score / C)`` before the mask (None: none).
    """
    B, num_heads, head_dim = q.shape
    kv_heads = k_layer.shape[2]
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of kv_heads {kv_heads}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    group = num_heads // kv_heads
    device = q.device
    seq_lens = seq_lens.to(device=device, dtype=torch.long)
    max_len = int(seq_lens.max()) if B else 0
    if max_len == 0:
        return torch.zeros_like(q)

    valid, pages, offsets = _key_slots(block_table, seq_lens, page_size, sliding_window, max_len, B)
    k = k_layer[pages, offsets].float()  # [B, L, Hkv, D]
    v = v_layer[pages, offsets].float()
    qf = q.float().view(B, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale  # [B, Hkv, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key at all
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(B, num_heads, head_dim).to(q.dtype)


def _check_pages_buffer(buffer: torch.Tensor) -> int:
    if buffer.dim() < 2:
        raise ValueError(f"page buffer needs a leading page dim and page contents, got {tuple(buffer.shape)}")
    if not buffer[0].is_contiguous():
        raise ValueError("each page buffer[p] must be contiguous")
    return buffer[0].numel()


def gather_pages_torch(buffer: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy whole pages ``buffer[page_ids[i]]`` into row i of a ``[n, page_numel]`` tensor.

    ``buffer`` ``[num_pages, ...]`` with each ``buffer[p]`` contiguous; ``page_ids`` int ``[n]``,
    each in ``[0, num_pages)``. ``out`` (optional) ``[n, page_numel]`` of buffer's dtype; the
    result is ``out`` or a new contiguous tensor on buffer's device.
    """
    numel = _check_pages_buffer(buffer)
    page_ids = page_ids.to(device=buffer.device, dtype=torch.long)
    rows = buffer[page_ids].reshape(page_ids.numel(), numel)
    if out is None:
        return rows
    out.copy_(rows)
    return out


def scatter_pages_torch(buffer: torch.Tensor, page_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Copy row i of ``src`` ``[n, page_numel]`` into page ``buffer[page_ids[i]]`` (in place).

    Invariants: ``page_ids`` unique, in ``[0, num_pages)``; ``src`` has buffer's dtype.
    """
    _check_pages_buffer(buffer)
    page_ids = page_ids.to(device=buffer.device, dtype=torch.long)
    buffer[page_ids] = src.to(buffer.device).reshape(page_ids.numel(), *buffer.shape[1:])
