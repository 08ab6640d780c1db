"""Page-major test pools for the transport tests: every page holds distinct known words."""

from __future__ import annotations

import numpy as np
import torch

# A small page-major pool: [pages, layers, 2, page_size, kv_heads, head_dim], fp32.
SHAPE = (48, 2, 2, 8, 2, 32)
PAGE_BYTES = int(np.prod(SHAPE[1:])) * 4  # 8 KiB


def make_pool(shape=SHAPE, fill: bool = False) -> torch.Tensor:
    buf = torch.zeros(shape, dtype=torch.float32)
    if fill:
        fill_pattern(buf)
    return buf


def fill_pattern(buf: torch.Tensor) -> None:
    """Page i holds int32 words i * 1_000_003 + j: every page distinct, every byte known."""
    words = buf.view(buf.shape[0], -1).view(torch.int32)
    n = words.shape[1]
    words.copy_(
        torch.arange(buf.shape[0], dtype=torch.int32)[:, None] * 1_000_003 + torch.arange(n, dtype=torch.int32)[None, :]
    )


def expected_page(i: int, shape=SHAPE) -> torch.Tensor:
    n = int(np.prod(shape[1:]))
    return torch.arange(n, dtype=torch.int32) + i * 1_000_003


def page_words(buf: torch.Tensor, i: int) -> torch.Tensor:
    return buf[i].reshape(-1).view(torch.int32)
