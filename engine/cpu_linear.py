"""``x @ W.T`` with the weight prepared once for the device: oneDNN-packed on CPU float32.

torch's ``F.linear`` on CPU float32 goes to MKL sgemm with the plain ``[out, in]`` weight. At the
row counts of a decode step (1-64) that runs at a fraction of the core's speed; a weight reordered
once into oneDNN's blocked layout (``mkldnn._reorder_linear_weight``, the path torch's own
inductor uses for frozen CPU linears) is 1.3-2.4x faster there and no slower for prefill-sized
inputs (measured on one AVX-512 core: 1536x576 at 8 rows 0.15 vs 0.30 ms, the 49152x576 LM head
at 8 rows 10.8 vs 26.4 ms, 512 rows 9.1 vs 10.9 ms). Results equal ``F.linear`` up to float32
rounding (another summation order).

Contract: ``pack(w)`` returns what ``linear(x, packed, bias)`` takes; ``linear`` of a plain tensor
is ``F.linear``. Packing happens only for 2-D float32 CPU weights when this torch has oneDNN;
anything else (CUDA, bf16, no oneDNN) stays a plain tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 32  # row count oneDNN picks the blocked layout for (any count works)


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out, in]`` weight in oneDNN's layout; ``shape`` is the original one."""

    data: torch.Tensor
    shape: torch.Size


def packing_enabled(w: torch.Tensor) -> bool:
    """True iff ``w`` is a weight ``pack`` would reorder on this machine."""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and torch.backends.mkldnn.is_available())


def pack(w: torch.Tensor) -> torch.Tensor | PackedWeight:
    """``w`` prepared for ``linear`` (reordered for oneDNN where that pays, else ``w`` itself)."""
    if not packing_enabled(w):
        return w
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT), w.shape)


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` over the last dimension of ``x``."""
    if isinstance(w, PackedWeight):
        return torch.ops.mkldnn._linear_pointwise(x, w.data, bias, "none", [], "")
    return F.linear(x, w, bias)
