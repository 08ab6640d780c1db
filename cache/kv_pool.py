"""Page-major paged KV storage.

Layout ``[num_pages, num_layers, 2, page_size, kv_heads, head_dim]``: one page of one request is a
single contiguous block holding every layer's K and V. That makes a page one transfer descriptor
(NIXL) and one memcpy for CPU offload (``docs/design/kv-layout.md``). Attention reads one layer
through strided views (``k_layer``/``v_layer``) indexed by ``(page, offset)``.
"""

from __future__ import annotations

import torch

from cache.pool_memory import zeroed


class KVPool:
    """Device KV buffer for ``num_layers`` layers. Owns memory only: which request holds which
    page is the ``PageAllocator``'s business, handed out as ``KVHandle``s by ``KVManager``.

    Slot ``s`` (the KV store kernels' flat index) means page ``s // page_size``, offset
    ``s % page_size``. Page 0 is a valid page like any other.
    """

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        buffer: torch.Tensor | None = None,
    ) -> None:
        """``buffer``: an existing ``[num_pages, num_layers, 2, page_size, kv_heads, head_dim]``
        tensor to use (a region of ``KVPools``' one allocation); a zeroed one is made otherwise."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"KV pool needs num_pages>0 and page_size>0, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
        if buffer is None:
            buffer = zeroed(shape, dtype, device)
        elif tuple(buffer.shape) != shape or buffer.dtype != dtype:
            raise ValueError(f"KV pool buffer is {tuple(buffer.shape)} {buffer.dtype}, expected {shape} {dtype}")
        self.buffer = buffer

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def k_layer(self, layer: int) -> torch.Tensor:
        """Strided view ``[num_pages, page_size, kv_heads, head_dim]`` of layer ``layer``'s K."""
        return self.buffer[:, layer, 0]

    def v_layer(self, layer: int) -> torch.Tensor:
        return self.buffer[:, layer, 1]

    def layout_descriptor(self) -> dict:
        """What a transfer handshake compares: shape, dtype and layout name."""
        return {
            "layout": "page_major_v1",
            "num_layers": self.num_layers,
            "page_size": self.page_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
