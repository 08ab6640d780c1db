"""One tensor of a GGUF file as a source read on access (``engine.checkpoint_tensors``): dequantized to
float32 when read, with llama.cpp's Q/K row interleave undone where the loader asks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.gguf_common import dequantize_tensor


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave: rows (head, pair, half) -> (head, half, pair).

    Works on a weight ``[out, in]`` or a bias ``[out]``; ``out == n_heads * head_dim``.
    """
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


@dataclass(frozen=True)
class GGUFSource:
    """One tensor of GGUF file ``path`` (``tensor``: the reader's entry), read as float32: dequantized
    and, for ``heads`` not None, llama.cpp's Q/K row interleave undone over that many heads."""

    tensor: Any
    path: Path
    heads: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensor.shape))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def read(self) -> torch.Tensor:
        """A new writable float32 CPU tensor (``ValueError`` naming the file for a corrupt one)."""
        w = dequantize_tensor(self.tensor, self.path)
        if self.heads is not None:
            w = unpermute_qk(w, self.heads)
        return torch.from_numpy(np.ascontiguousarray(w))
