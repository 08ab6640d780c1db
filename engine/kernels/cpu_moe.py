"""The Python face of ``cpu_moe.c``: one mixture-of-experts layer's chosen experts for a step's tokens,
grouped by expert, each expert's gate/up and down weights read once per call whatever its token count.

``expert_ffn`` takes the grouping ``engine.moe`` builds (the chosen experts in increasing order, the
offsets of their (token, weight) pairs) and returns the weighted sum of the experts' SwiGLU outputs per
token in float32; the caller casts it to the model dtype. ``takes`` says whether the kernel runs a
layer's tensors here; where it does not, ``engine.moe`` keeps its torch matmuls.

``expert_gemm`` (``cpu_moe_gemm.c``) computes the same for large steps from the experts in the pair-panel
layout (``to_pairs``, prepared once at load): each expert's tokens register-blocked against its weights.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.cpu_library import load, openmp_shared

# cpu_moe.c's kinds: float32; bfloat16 (vdpbf16ps where the CPU has AVX512-BF16); bfloat16 widened to
# float32 on any CPU (what a CPU without AVX512-BF16 runs; the tests compare the two)
KIND_F32, KIND_BF16, KIND_BF16_WIDEN = 0, 1, 2
KIND_I8 = 3  # weight-only int8 experts (float32 row scales) against bfloat16 x; AVX512-BF16 only
# the experts in to_pairs' layout, run by cpu_moe_gemm.c (the decode stack's kinds where it has them)
KIND_GEMM_BF16, KIND_GEMM_I8 = 4, 5
ROW_MULTIPLE = 32  # hidden and expert sizes the kernel takes: multiples of 32
PANEL = 64  # cpu_moe_gemm.c's outputs per panel: hidden and expert sizes multiples of 64


@functools.lru_cache(maxsize=1)
def dot_available() -> bool:
    """True iff this build takes the bfloat16 products by vdpbf16ps (the CPU has AVX512-BF16)."""
    lib = load()
    return lib is not None and lib.pdserve_moe_dot_available() == 1


def _dtypes_run(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if gate_up.dtype == torch.int8:
        return x.dtype == torch.bfloat16 and down.dtype == torch.int8 and dot_available()
    return x.dtype in (torch.float32, torch.bfloat16) and gate_up.dtype == x.dtype == down.dtype


def takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """True iff :func:`expert_ffn` runs ``x`` ``[rows, hidden]`` against these stacked experts
    (``[E, 2 * inter, hidden]``, ``[E, hidden, inter]``): CPU tensors of one dtype, float32 or bfloat16,
    or int8 experts against bfloat16 ``x`` where the CPU has AVX512-BF16; contiguous experts, ``x``'s
    last dim contiguous, sizes multiples of 32, and the library built."""
    return (
        x.device.type == "cpu"
        and load() is not None
        and _dtypes_run(x, gate_up, down)
        and gate_up.device.type == "cpu"
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and x.stride(-1) == 1
        and x.shape[-1] % ROW_MULTIPLE == 0
        and down.shape[-1] % ROW_MULTIPLE == 0
    )


def expert_ffn(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    chosen: torch.Tensor,
    offsets: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_weights: torch.Tensor,
    kind: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """``out[t] = sum over pairs (t, w) of expert e: w * down_e(SiLU(gate_e x_t) * up_e x_t)``, float32
    ``[rows, hidden]``, experts added in ``chosen``'s order. ``chosen`` int64 ``[A]`` (increasing),
    ``offsets`` int64 ``[A + 1]``: expert ``chosen[a]``'s pairs are ``[offsets[a], offsets[a + 1])`` of
    ``pair_tokens`` (int64, a token at most once per expert) and ``pair_weights`` (float32). The caller
    guarantees :func:`takes`. ``kind``: one of the ``KIND_*`` (default: the dtype's fastest).
    ``scales``: int8 experts' float32 row scales ``([E, 2 * inter], [E, hidden])``, contiguous. None
    where the kernel refuses the shape."""
    inter = down.shape[-1]
    if kind is None:
        kind = KIND_I8 if gate_up.dtype == torch.int8 else KIND_F32 if x.dtype == torch.float32 else KIND_BF16
    return _run_experts(
        load().pdserve_moe_experts,
        x,
        (gate_up, down),
        kind,
        scales,
        (chosen, offsets, pair_tokens, pair_weights),
        x.dtype,
        inter,
    )


@functools.lru_cache(maxsize=1)
def gemm_available() -> bool:
    """True iff this build has ``cpu_moe_gemm.c``'s kernel (the CPU has AVX512-BF16)."""
    lib = load()
    return lib is not None and lib.pdserve_moe_gemm_available() == 1


def to_pairs(t: torch.Tensor) -> torch.Tensor:
    """Stacked experts ``t`` ``[E, out, in]`` (out % 64 == 0, in even) in ``cpu_moe_gemm.c``'s layout,
    each expert in ``cpu_gemm_pairs.c``'s pair panels ``[E][out / 64][in / 2][4][16][2]``: element
    ``(e, o, k)`` at ``[e][o // 64][k // 2][o % 64 // 16][o % 16][k % 2]``."""
    e, out, inp = t.shape
    return t.reshape(e, out // PANEL, 4, 16, inp // 2, 2).permute(0, 1, 4, 2, 3, 5).contiguous()


def from_pairs(p: torch.Tensor) -> torch.Tensor:
    """The stacked experts ``[E, out, in]`` that :func:`to_pairs` laid out as ``p`` (a new tensor)."""
    e, panels, half = p.shape[:3]
    return p.permute(0, 1, 3, 4, 2, 5).reshape(e, panels * PANEL, half * 2)


def pairs_take(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """True iff :func:`expert_gemm` runs ``x`` ``[rows, hidden]`` against experts laid out by
    :func:`to_pairs` (``gate_up`` from ``[E, 2 * inter, hidden]``, ``down`` from ``[E, hidden, inter]``):
    bfloat16 ``x`` on the CPU, its last dim contiguous and of the experts' hidden size, bfloat16 or int8
    panels of one dtype, contiguous, and the kernel built (AVX512-BF16)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.stride(-1) == 1
        and gate_up.dim() == down.dim() == 6
        and gate_up.dtype == down.dtype
        and gate_up.dtype in (torch.bfloat16, torch.int8)
        and gate_up.device.type == "cpu"
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and x.shape[-1] == gate_up.shape[2] * 2 == down.shape[1] * PANEL
        and gate_up.shape[1] == down.shape[2] * 4 // PANEL
        and gemm_available()
    )


def gemm_takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """True iff :func:`expert_gemm` runs ``x`` against these stacked experts (row-major shapes, as
    :func:`takes`): bfloat16 ``x``, bfloat16 or int8 experts, hidden and expert sizes multiples of 64,
    on a CPU with AVX512-BF16."""
    return (
        takes(x, gate_up, down)
        and x.dtype == torch.bfloat16
        and gate_up.dtype in (torch.bfloat16, torch.int8)
        and x.shape[-1] % PANEL == 0
        and down.shape[-1] % PANEL == 0
        and gemm_available()
    )


def expert_gemm(
    x: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor],
    chosen: torch.Tensor,
    offsets: torch.Tensor,
    pair_tokens: torch.Tensor,
    pair_weights: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """What :func:`expert_ffn` computes, by ``cpu_moe_gemm.c``: ``pairs`` the experts' gate/up and down
    weights in :func:`to_pairs`' layout (bfloat16, or int8 with ``scales`` as there); the grouping as
    :func:`expert_ffn`'s. float32 ``[rows, hidden]``; None where the kernel refuses."""
    inter = pairs[0].shape[1] * PANEL // 2
    kind = int(pairs[0].dtype == torch.int8)
    grouping = (chosen, offsets, pair_tokens, pair_weights)
    return _run_experts(load().pdserve_moe_gemm, x, pairs, kind, scales, grouping, torch.bfloat16, inter)


def _run_experts(
    entry,
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor],
    kind: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    grouping: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    act_dtype: torch.dtype,
    inter: int,
) -> torch.Tensor | None:
    """Call a C expert entry point (``pdserve_moe_experts`` or ``pdserve_moe_gemm``: one signature)
    over ``x`` with the grouping ``(chosen, offsets, pair_tokens, pair_weights)``; float32
    ``[rows, hidden]``, None where the kernel refused (non-zero return)."""
    (rows, hidden), (gate_up, down) = x.shape, weights
    chosen, offsets, pair_tokens, pair_weights = grouping
    gate_up_scale, down_scale = (0, 0) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
    act = torch.empty(pair_tokens.shape[0], inter, dtype=act_dtype)
    out = torch.zeros(rows, hidden, dtype=torch.float32)
    rc = entry(
        x.data_ptr(),
        x.stride(0),
        gate_up.data_ptr(),
        down.data_ptr(),
        kind,
        gate_up_scale,
        down_scale,
        chosen.data_ptr(),
        offsets.data_ptr(),
        pair_tokens.data_ptr(),
        pair_weights.data_ptr(),
        act.data_ptr(),
        out.data_ptr(),
        chosen.shape[0],
        hidden,
        inter,
        torch.get_num_threads() if openmp_shared() else 1,
    )
    return out if rc == 0 else None
