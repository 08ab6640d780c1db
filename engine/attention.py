"""Attention backends over the page-major KV pool.

Interface (``AttentionBackend``):
- ``prepare(batch)`` once per forward step: builds index metadata shared by all layers;
- ``forward(q, k, v, layer, batch)``: stores the new tokens' K/V into ``batch.out_slots`` of the
  layer, then returns attention output ``[tokens, num_heads * head_dim]`` for the new tokens.

A MIXED batch (decode rows first, then extend rows; ``ForwardBatch.split``) is stored in one call
and attended in two: its decode rows through the backend's decode path, its extend rows through
the extend path, each over its own part of the batch; per-step metadata is cached per part.

``TorchBackend`` runs anywhere (default on CPU): it gathers each request's K/V through the block
table of the layer's pool (only the keys inside a sliding layer's window) and calls
``scaled_dot_product_attention`` with a causal / sliding-window mask; with a soft cap (Gemma 2's
``attn_logit_softcapping``: scores become ``cap * tanh(scores / cap)`` before the mask), which SDPA
cannot apply, it computes the scores, caps, masks and softmaxes (float32) itself. The C and Triton
kernels take the cap too. With attention sinks (gpt-oss: ``forward(..., sinks=)``, one logit per head
in each softmax's denominator) every backend runs this torch path (``attention_ops.sink_attention``):
the C and Triton kernels do not compute sinks.
``CpuBackend`` (default on CPU for float32 and bfloat16 pools when the C kernel builds) runs decode with the C
kernel of ``engine/kernels/cpu_native.py``, which reads each request's keys in place (no gather,
no padding to the longest request in the batch); extend steps reuse the torch gather path.
``TritonBackend`` (CUDA) stores K/V and runs paged decode attention with the Triton kernels in
``engine/kernels``; extend steps reuse the torch gather path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cache.kv_pool import KVPool
from cache.kv_pools import FULL, KVPools
from engine.attention_ops import capped_attention, extend_mask, sdpa_4d, sink_attention
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kernels import fused


@dataclass
class _Gather:
    """Per-step gather indices of one (pool, window), in whole pages: request i's gathered key j
    is the token at ``key_pos[i, j]`` (``starts[i] + j``, ``starts`` page aligned), read from page
    ``pages[i, j // P]``; ``valid`` marks positions that exist (``< seq_len``). A window gathers
    only the pages its queries can see. Gathering pages (contiguous ``[P, heads, dim]`` blocks of
    the page-major pool) instead of tokens copies the same bytes with P times fewer indices."""

    pages: torch.Tensor  # [B, n_pages] int64
    key_pos: torch.Tensor  # [B, n_pages * P] int64
    valid: torch.Tensor  # [B, n_pages * P] bool
    starts: list[int]


def _gather_meta(table: torch.Tensor, batch: ForwardBatch, window: int | None) -> _Gather:
    P = batch.page_size
    prefixes = [s - e for s, e in zip(batch.seq_lens_cpu, batch.extend_lens_cpu)]
    first = [max(0, p - window + 1) // P if window else 0 for p in prefixes]
    n_pages = max(-(-s // P) - f for s, f in zip(batch.seq_lens_cpu, first))
    dev = table.device
    cols = torch.as_tensor(first, device=dev).unsqueeze(1) + torch.arange(n_pages, device=dev)
    exists = cols * P < batch.seq_lens.unsqueeze(1)
    pages = torch.where(exists, torch.gather(table.long(), 1, cols.clamp(max=table.shape[1] - 1)), 0)
    key_pos = (cols * P).repeat_interleave(P, dim=1) + torch.arange(P, device=dev).repeat(n_pages)
    return _Gather(pages, key_pos, key_pos < batch.seq_lens.unsqueeze(1), [f * P for f in first])


class TorchBackend:
    """Reference paged attention built from torch ops (CPU and CUDA).

    Each layer reads its own pool (``KVPools.layer_pool``): full-attention layers the full pool,
    sliding layers of a hybrid the SWA pool through the batch's SWA block table."""

    def __init__(
        self, pools: KVPools, num_heads: int, scale: float, windows: list[int | None], softcap: float | None = None
    ) -> None:
        self.pools = pools
        self.num_heads = num_heads
        self.scale = scale
        self.windows = windows
        self.softcap = softcap
        self._batch: ForwardBatch | None = None
        self._parts: tuple[ForwardBatch, ForwardBatch] | None = None
        self._meta: dict[tuple[ForwardMode, str, int | None], _Gather] = {}
        self._masks: dict[tuple[ForwardMode, str, int | None], torch.Tensor] = {}

    @property
    def pool(self) -> KVPool:
        return self.pools.full

    def prepare(self, batch: ForwardBatch) -> None:
        self._batch, self._meta, self._masks = batch, {}, {}
        self._parts = batch.split() if batch.mode is ForwardMode.MIXED else None

    def _layer(self, layer: int) -> tuple[str, KVPool, int]:
        name, local = self.pools.layer_pool[layer]
        return name, self.pools.pool(name), local

    def _gather_of(self, batch: ForwardBatch, name: str, window: int | None) -> _Gather:
        """Gather indices of ``batch`` (the step's batch or one part of a MIXED one)."""
        key = (batch.mode, name, window)
        if key not in self._meta:
            table, _ = batch.pool_index(name)
            self._meta[key] = _gather_meta(table, batch, window)
        return self._meta[key]

    def store(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        name, pool, local = self._layer(layer)
        slots = self._batch.pool_index(name)[1]
        P = self._batch.page_size
        pages, offsets = torch.div(slots, P, rounding_mode="floor"), slots % P
        # one index_put for K and V: [T, 2, heads, dim] into (page, layer, :, offset)
        pool.buffer[pages, local, :, offsets] = torch.stack((k, v), 1).to(pool.dtype)

    def forward(self, q, k, v, layer: int, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new K/V, then attend. ``sinks`` ``[num_heads]`` float32: each head's sink logit,
        computed by the torch paths whatever the backend (None: no sinks, the backend's own paths)."""
        self.store(k, v, layer)
        if sinks is not None:
            return self._with_sinks(q, k, v, layer, batch, sinks)
        if batch.mode is ForwardMode.DECODE:
            return self._decode(q, layer, batch)
        if batch.mode is ForwardMode.EXTEND:
            return self._extend(q, k, v, layer, batch)
        (dec, ext), d = self._parts, batch.num_decode
        return torch.cat((self._decode(q[:d], layer, dec), self._extend(q[d:], k[d:], v[d:], layer, ext)))

    def _with_sinks(self, q, k, v, layer: int, batch: ForwardBatch, sinks: torch.Tensor) -> torch.Tensor:
        """The torch decode / extend paths with ``sinks`` over the stored pool (subclasses' kernels
        bypassed: they do not compute sinks)."""
        if batch.mode is ForwardMode.DECODE:
            return TorchBackend._decode(self, q, layer, batch, sinks)
        if batch.mode is ForwardMode.EXTEND:
            return TorchBackend._extend(self, q, k, v, layer, batch, sinks)
        (dec, ext), d = self._parts, batch.num_decode
        return torch.cat(
            (
                TorchBackend._decode(self, q[:d], layer, dec, sinks),
                TorchBackend._extend(self, q[d:], k[d:], v[d:], layer, ext, sinks),
            )
        )

    def _gather(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, _Gather]:
        """``(K, V)`` ``[B, n_pages * P, kv_heads, dim]`` of ``layer`` over ``batch``'s pages."""
        name, pool, local = self._layer(layer)
        m = self._gather_of(batch, name, self.windows[layer])
        B, n = m.pages.shape
        k = pool.buffer[m.pages, local, 0].view(B, n * pool.page_size, pool.num_kv_heads, pool.head_dim)
        v = pool.buffer[m.pages, local, 1].view(B, n * pool.page_size, pool.num_kv_heads, pool.head_dim)
        return k, v, m

    def _mask(self, layer: int, batch: ForwardBatch, m: _Gather) -> torch.Tensor:
        """Decode mask [B, 1, 1, L]: key exists and is inside the sliding window."""
        key = (batch.mode, self._layer(layer)[0], self.windows[layer])
        if key not in self._masks:
            mask = m.valid
            if key[2] is not None:
                mask = mask & (m.key_pos >= batch.seq_lens.unsqueeze(1) - key[2])
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def _decode(self, q, layer: int, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k, v, m = self._gather(layer, batch)  # [B, L, Hkv, D]
        qd = q.unsqueeze(2)  # [B, H, 1, D]
        kd, vd = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
        mask = self._mask(layer, batch, m)
        if sinks is not None:
            out = sink_attention(qd, kd.to(q.dtype), vd.to(q.dtype), self.scale, sinks, mask)
        elif self.softcap is not None:
            out = capped_attention(qd, kd.to(q.dtype), vd.to(q.dtype), self.scale, self.softcap, mask)
        else:
            out = F.scaled_dot_product_attention(
                qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return out.reshape(q.shape[0], -1)

    def _extend(self, q, k, v, layer: int, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Per request: causal attention of its new tokens over prefix (from the pool) + new (with
        ``sinks``: :func:`sink_attention` under an explicit mask)."""
        window = self.windows[layer]
        gathered = None
        outs, start = [], 0
        for i, (seq, ext) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            qi = q[start : start + ext].transpose(0, 1)  # [H, E, D]
            if seq == ext:  # no prefix: the chunk's own K/V
                ki, vi = k[start : start + ext].transpose(0, 1), v[start : start + ext].transpose(0, 1)
                mask = None if window is None else extend_mask(0, ext, 0, seq, window, q.device)
                if mask is None and (self.softcap is not None or sinks is not None):
                    mask = extend_mask(0, ext, 0, seq, None, q.device)
                o = self._attend(qi, ki, vi, is_causal=mask is None, mask=mask, sinks=sinks)
            else:
                if gathered is None:
                    gathered = self._gather(layer, batch)
                k_all, v_all, m = gathered
                n = seq - m.starts[i]
                ki = k_all[i, :n].transpose(0, 1).to(q.dtype)  # [Hkv, n, D]
                vi = v_all[i, :n].transpose(0, 1).to(q.dtype)
                mask = extend_mask(seq - ext, ext, m.starts[i], seq, window, q.device)
                o = self._attend(qi, ki, vi, mask=mask, sinks=sinks)
            outs.append(o.transpose(0, 1).reshape(ext, -1))
            start += ext
        return torch.cat(outs, dim=0)

    def _attend(self, q, k, v, is_causal: bool = False, mask=None, sinks=None) -> torch.Tensor:
        """Prefill attention ``[H, E, D]`` x ``[Hkv, S, D]``: SDPA, or the sink or soft-capped path."""
        if sinks is not None:
            return sink_attention(q, k, v, self.scale, sinks, mask)
        if self.softcap is not None:
            return capped_attention(q, k, v, self.scale, self.softcap, mask)
        return sdpa_4d(q, k, v, self.scale, is_causal=is_causal, mask=mask)


# Longest request (prefix + new tokens) whose prefill attention runs through the per-row C paged kernel
# when the tiled one does not take the shape; a bfloat16 256-token prompt took 107 ms that way against
# 118 with SDPA, a 1,024-token one 740 vs 659.
KERNEL_EXTEND_MAX_SEQ = 512


class CpuBackend(TorchBackend):
    """CPU float32/bfloat16 pools: decode and prefill through the C paged kernels (prefill: the tiled
    kernel where the shape fits, see ``_extend``) with at most ``threads`` threads (default:
    torch's thread count at each call, which core lending may change between steps), fewer when the
    step's keys are too few to pay for starting them (``cpu_native.threads_for``); the rest as torch."""

    def __init__(
        self,
        pools: KVPools,
        num_heads: int,
        scale: float,
        windows: list[int | None],
        threads: int | None = None,
        softcap: float | None = None,
    ) -> None:
        from engine.kernels import decode_prefetch

        super().__init__(pools, num_heads, scale, windows, softcap)
        self.threads = threads
        self.prefetch = decode_prefetch.modes().attention  # timed once per process: speed only
        self._ranges: dict[tuple[ForwardMode, str, int | str | None], tuple] = {}
        self._slots: dict[str, torch.Tensor] = {}

    def prepare(self, batch: ForwardBatch) -> None:
        super().prepare(batch)
        self._ranges = {}
        self._slots: dict[str, torch.Tensor] = {}

    def store(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        """The C row copy (``fused.store_kv``) where it applies, torch's index_put otherwise. Slots
        are range-checked once per step and pool: the kernel writes raw memory."""
        name, pool, local = self._layer(layer)
        if not fused.store_kv(pool.buffer, local, self._checked_slots(name), k, v):
            super().store(k, v, layer)

    def _checked_slots(self, name: str) -> torch.Tensor:
        """The step's out slots of pool ``name`` as contiguous int64, each checked once per step."""
        slots = self._slots.get(name)
        if slots is None:
            pool = self.pools.pool(name)
            slots = self._batch.pool_index(name)[1].to(torch.int64).contiguous()
            limit = pool.num_pages * pool.page_size
            if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < limit):
                raise IndexError(f"{name} slot outside 0..{limit - 1}")
            self._slots[name] = slots
        return slots

    def pool_decode(
        self, batch: ForwardBatch, name: str = FULL, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(table, lo, hi, slots, keys)`` of the prepared DECODE ``batch`` over pool ``name`` (``FULL``
        or ``SWA``) under ``window`` (None: none; else each request's last ``window`` keys), every page
        and slot checked against the pool (int64, contiguous): what the C decode stack
        (``engine.decode_stack``) reads for the layers of that pool and window, as ``_decode`` does."""
        table, lo, hi, keys = self._range_of(batch, name, window)
        return table, lo, hi, self._checked_slots(name), keys

    def _range_of(
        self, batch: ForwardBatch, name: str, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(table, lo, hi, keys)`` of ``batch``'s decode rows (int64 tensors): request i attends
        to keys ``[lo[i], hi[i])``; ``keys`` is their total over the batch."""
        key = (batch.mode, name, window)
        if key not in self._ranges:
            table, _ = self._range_of_table(batch, name)
            hi = batch.seq_lens.to(torch.int64).contiguous()
            lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
            self._ranges[key] = (table, lo.contiguous(), hi, int((hi - lo).sum()))
        return self._ranges[key]

    def _extend_range_of(
        self, batch: ForwardBatch, name: str, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(table, lo, hi, keys)`` with one row per new token of ``batch`` (EXTEND): the token at
        position p of request i attends to keys ``[lo, p + 1)`` through request i's block table."""
        key = (batch.mode, name, window)
        if key not in self._ranges:
            table, _ = self._range_of_table(batch, name)
            ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
            req = torch.repeat_interleave(torch.arange(len(ext)), ext)
            starts = torch.cumsum(ext, 0) - ext
            hi = (batch.seq_lens.to(torch.int64) - ext)[req] + torch.arange(int(ext.sum())) - starts[req] + 1
            lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
            self._ranges[key] = (table[req].contiguous(), lo.contiguous(), hi.contiguous(), int((hi - lo).sum()))
        return self._ranges[key]

    def _range_of_table(self, batch: ForwardBatch, name: str) -> tuple[torch.Tensor, int]:
        """``batch``'s block table for pool ``name`` as contiguous int64, every page id checked."""
        table = batch.pool_index(name)[0].to(torch.int64).contiguous()
        pages = self.pools.pool(name).num_pages
        if table.numel() and not (0 <= int(table.min()) and int(table.max()) < pages):
            # the kernel reads raw memory: a bad page id would crash the process, not raise
            raise IndexError(f"{name} block table holds a page outside 0..{pages - 1}")
        return table, pages

    def _extend(self, q, k, v, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Prefill attention read from the pool (``store`` ran first, so every key, prefix included,
        is there), all requests in one call: the tiled kernel (``cpu_native.paged_extend``) where the
        shape fits it, else the per-row paged kernel up to ``KERNEL_EXTEND_MAX_SEQ`` tokens, else
        torch's flash SDPA."""
        from engine.kernels.cpu_native import extend_supported, paged_extend, threads_for

        name, pool, local = self._layer(layer)
        window = self.windows[layer]
        if extend_supported(q.shape[1], pool.num_kv_heads, q.shape[2]):
            table, qstart, pos0, ext, keys = self._extend_tiles_of(batch, name)
            threads = threads_for(keys, q.shape[1], q.shape[2], self.threads or torch.get_num_threads())
            out = paged_extend(
                q, pool.buffer, local, table, qstart, pos0, ext, window, self.scale, threads, softcap=self.softcap
            )
            return out.to(q.dtype).reshape(q.shape[0], -1)
        if max(batch.seq_lens_cpu, default=0) > KERNEL_EXTEND_MAX_SEQ:
            return super()._extend(q, k, v, layer, batch)
        return self._ranged(q, pool, local, *self._extend_range_of(batch, name, window))

    def _extend_tiles_of(self, batch: ForwardBatch, name: str):
        """``(table, qstart, pos0, ext, keys)`` of ``batch`` (EXTEND) for ``paged_extend``: request
        i's new tokens are rows ``[qstart[i], +ext[i])`` at positions ``pos0[i] + j``; ``keys`` is
        the causal key count summed over the rows (an upper bound under a window: threads only)."""
        key = (batch.mode, name, "tiles")
        if key not in self._ranges:
            table, _ = self._range_of_table(batch, name)
            ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
            seq = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)
            keys = int(sum(e * s - e * (e - 1) // 2 for e, s in zip(batch.extend_lens_cpu, batch.seq_lens_cpu)))
            self._ranges[key] = (table, (torch.cumsum(ext, 0) - ext).contiguous(), (seq - ext).contiguous(), ext, keys)
        return self._ranges[key]

    def _decode(self, q, layer: int, batch: ForwardBatch) -> torch.Tensor:
        name, pool, local = self._layer(layer)
        return self._ranged(q, pool, local, *self._range_of(batch, name, self.windows[layer]))

    def _ranged(self, q, pool, local: int, table, lo, hi, keys: int) -> torch.Tensor:
        """Each query row attends to keys ``[lo[i], hi[i])`` of its request's pages (``table``): the
        per-row paged kernel, for decode rows and for extend rows it serves."""
        from engine.kernels.cpu_native import paged_decode, threads_for

        threads = threads_for(keys, q.shape[1], q.shape[2], self.threads or torch.get_num_threads())
        # a bfloat16 query loses nothing to bfloat16 products (the decode stack takes the same path)
        out = paged_decode(
            q,
            pool.buffer,
            local,
            table,
            lo,
            hi,
            self.scale,
            threads,
            self.prefetch,
            dot=q.dtype == torch.bfloat16,
            softcap=self.softcap,
        )
        return out.to(q.dtype).reshape(q.shape[0], -1)


class TritonBackend(TorchBackend):
    """CUDA backend: Triton KV store and paged decode attention; extend via the torch path.
    ``kernels``: the kernel entry points' ``backend`` (None: Triton on CUDA tensors; "triton"
    forces it, which on CPU tensors runs the Triton interpreter: tests)."""

    def __init__(
        self,
        pools: KVPools,
        num_heads: int,
        scale: float,
        windows: list[int | None],
        kernels: str | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(pools, num_heads, scale, windows, softcap)
        self.kernels = kernels

    def store(self, k, v, layer: int) -> None:
        from engine.kernels import store_kv

        name, pool, local = self._layer(layer)
        store_kv(pool.k_layer(local), pool.v_layer(local), self._batch.pool_index(name)[1], k, v, backend=self.kernels)

    def _decode(self, q, layer: int, batch: ForwardBatch) -> torch.Tensor:
        from engine.kernels import paged_decode_attention

        name, pool, local = self._layer(layer)
        out = paged_decode_attention(
            q,
            pool.k_layer(local),
            pool.v_layer(local),
            batch.pool_index(name)[0],
            batch.seq_lens,
            self.scale,
            batch.page_size,
            sliding_window=self.windows[layer],
            softcap=self.softcap,
            backend=self.kernels,
        )
        return out.reshape(q.shape[0], -1)


def _cpu_kernel_fits(pools: KVPools) -> bool:
    from engine.kernels.cpu_native import supports

    return all(supports(p.buffer) for p in (pools.full, pools.swa) if p is not None)


def make_backend(
    name: str, pools: KVPools, num_heads: int, scale: float, windows, softcap: float | None = None
) -> TorchBackend:
    """``name``: "auto" (Triton on CUDA; on CPU the C kernel where it fits, else torch), "torch",
    "cpu" or "triton". ``softcap``: attention logit soft cap (None: none), applied by every backend."""
    device = pools.full.device
    if name == "auto":
        name = "triton" if device.type == "cuda" else ("cpu" if _cpu_kernel_fits(pools) else "torch")
    if name == "torch":
        return TorchBackend(pools, num_heads, scale, windows, softcap)
    if name == "cpu":
        if not _cpu_kernel_fits(pools):
            raise ValueError(
                "attention_backend=cpu needs a float32 or bfloat16 CPU KV pool and a C compiler (cc) to build "
                "the kernel; use --attention-backend torch"
            )
        return CpuBackend(pools, num_heads, scale, windows, softcap=softcap)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend=triton needs a CUDA device; use --attention-backend torch")
        return TritonBackend(pools, num_heads, scale, windows, softcap=softcap)
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch, cpu or triton")
