"""KV-cache kernels: Triton on CUDA, pure torch elsewhere (and as the test oracle); on CPU float32
the decode attention of ``engine.attention.CpuBackend`` is C (``cpu_native.paged_decode``,
built on first use; not re-exported here so importing this package never runs a compiler).

Importing this package never imports triton; kernels are built on first Triton call, for the
interpreter when the tensors are on CPU or ``TRITON_INTERPRET=1``.

- ``store_kv(k_layer, v_layer, slots, k, v, *, backend=None)``
- ``paged_decode_attention(q, k_layer, v_layer, block_table, seq_lens, scale, page_size,
  sliding_window=None, *, backend=None, use_dot=None, block_n=None) -> [B, num_heads, head_dim]``
- ``gather_pages(buffer, page_ids, out=None, *, backend=None) -> [n, page_numel]``
- ``scatter_pages(buffer, page_ids, src, *, backend=None)``
"""

from engine.kernels._dispatch import resolve_backend, triton_available
from engine.kernels.decode_attention import paged_decode_attention
from engine.kernels.page_copy import gather_pages, scatter_pages
from engine.kernels.reference import (
    gather_pages_torch,
    paged_decode_attention_torch,
    scatter_pages_torch,
    store_kv_torch,
)
from engine.kernels.store_kv import store_kv

__all__ = [
    "store_kv",
    "paged_decode_attention",
    "gather_pages",
    "scatter_pages",
    "store_kv_torch",
    "paged_decode_attention_torch",
    "gather_pages_torch",
    "scatter_pages_torch",
    "resolve_backend",
    "triton_available",
]
