"""Weight layouts of the CPU matmul kernels (``engine/kernels/cpu_gemm_pairs.c``) and weight-only int8
rows: pure tensor reshapes and the quantizer, no dispatch (that is ``engine.cpu_linear``'s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import cpu_native


@dataclass(frozen=True)
class Int8Rows:
    """A weight-only int8 ``[out, in]`` weight: ``q`` int8 (|q| <= 127), ``scale`` float32 ``[out]``;
    it stands for ``q * scale[:, None]``. ``pairs``: ``q`` in the pair-panel layout (``to_pairs``)
    where the shape allows it and the kernel is built, else None."""

    q: torch.Tensor
    scale: torch.Tensor
    pairs: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


def quantize_int8(w: torch.Tensor) -> Int8Rows:
    """Symmetric per-output-row int8 of a 2-D weight: scale = max |row| / 127 (1 for an all-zero
    row), q = round(w / scale). Every element is within scale / 2 of ``w``."""
    wf = w.float()
    absmax = wf.abs().amax(dim=1)
    scale = torch.where(absmax > 0, (absmax / 127).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(absmax))
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return Int8Rows(q, scale.contiguous(), to_pairs(q) if pairs_shape(q) and cpu_native.pairs_available() else None)


def pairs_shape(w: torch.Tensor) -> bool:
    """True iff ``w`` ``[out, in]`` fits the pair-panel layout: out % 64 == 0, in even and > 0."""
    out, inp = w.shape
    return out % cpu_native.PAIRS_PANEL == 0 and inp % 2 == 0 and inp > 0


def to_panels_f32(w: torch.Tensor) -> torch.Tensor:
    """float32 ``w`` ``[out, in]`` (out % 64 == 0) in ``cpu_gemm_pairs.c``'s float32 panel layout
    ``[out / 64][in][4][16]``: element ``(o, k)`` at ``[o // 64][k][o % 64 // 16][o % 16]``."""
    out, inp = w.shape
    return w.reshape(out // 64, 4, 16, inp).permute(0, 3, 1, 2).contiguous()


def to_pairs(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[out, in]`` (out % 64 == 0, in even) in ``cpu_gemm_pairs.c``'s pair-panel layout
    ``[out / 64][in / 2][4][16][2]``: element ``(o, k)`` at ``[o // 64][k // 2][o % 64 // 16][o % 16][k % 2]``."""
    out, inp = w.shape
    return w.reshape(out // 64, 4, 16, inp // 2, 2).permute(0, 3, 1, 2, 4).contiguous()
