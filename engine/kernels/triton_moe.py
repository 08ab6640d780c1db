"""Fused mixture-of-experts on Triton: a step's experts as two grouped GEMMs over its (token, slot)
pairs sorted by expert, the CUDA path of ``engine.moe.moe_mlp``.

``align`` lays the pairs out (host side, torch ops only, no device sync): sorted by expert, each
expert's group padded to a multiple of ``block_m``, one expert id per block. The gate/up kernel
then multiplies each block of pairs by its expert's gate and up rows and writes SiLU(gate) * up;
the down kernel multiplies those activations by the expert's down rows and writes each pair's
output times its routing weight into a float32 ``[pairs, hidden]`` buffer, which torch sums over a
token's slots and rounds once to the activations' dtype. Importing this module never imports
triton; the kernels are built on the first call, for the interpreter on CPU tensors or under
``TRITON_INTERPRET=1`` (how the tests run them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels._dispatch import resolve_backend, use_interpreter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Alignment:
    """The (token, slot) pairs of a step grouped by expert in blocks of ``block_m``.

    ``sorted_pairs`` int32 ``[num_blocks * block_m]``: pair ids (``token * top_k + slot``), the
    experts in increasing id and each expert's pairs in increasing pair id, each expert's group
    starting at a multiple of ``block_m`` and its tail padded with ``num_pairs``; every pair id in
    ``[0, num_pairs)`` appears exactly once. ``block_expert`` int32 ``[num_blocks]``: the expert
    of every block, -1 for the blocks after the last group (``num_blocks`` is an upper bound
    computed without reading the counts back from the device)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        """Blocks of ``block_m`` sorted positions: the first grid dimension of both kernels."""
        return self.block_expert.numel()


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The :class:`Alignment` of ``experts`` ``[tokens, top_k]`` (expert ids in ``[0, num_experts)``)
    for blocks of ``block_m`` pairs; tensors on ``experts``' device."""
    flat = experts.flatten().long()
    num_pairs = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    group_start = counts.cumsum(0) - counts
    by_expert = flat[order]
    pos = (padded_end - padded)[by_expert] + torch.arange(num_pairs, device=dev) - group_start[by_expert]
    # each expert that has pairs adds fewer than block_m padding slots, and at most num_pairs have pairs
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_blocks = -(-bound // block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[pos] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_pairs, block_expert, num_pairs, block_m)


def takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, scales) -> bool:
    """True when :func:`fused_moe` runs these tensors by default: all on CUDA with triton importable,
    ``x`` float32/float16/bfloat16 and the experts of its dtype, or int8 with their row ``scales``."""
    if resolve_backend(None, x, gate_up, down) != "triton" or x.dtype not in DTYPES:
        return False
    if scales is not None:
        return gate_up.dtype == down.dtype == torch.int8
    return gate_up.dtype == down.dtype == x.dtype


def _blocks(num_pairs: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Default ``(block_m, block_n, block_k)``: 16-row blocks for decode-sized steps (most experts
    get a pair or two), 64 beyond; float32 tiles half as deep (twice the bytes per element)."""
    block_m = 16 if num_pairs <= 1024 else 64
    return block_m, 64, 32 if dtype == torch.float32 else 64


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The expert mixture of ``x`` ``[tokens, hidden]``: sum over slots j of ``weights[t, j]`` times
    expert ``experts[t, j]``'s SwiGLU of ``x[t]``; returns ``[tokens, hidden]`` in ``x.dtype``.

    ``gate_up`` ``[E, 2 * inter, hidden]`` (gate rows first), ``down`` ``[E, hidden, inter]``, any
    strides; float in ``x.dtype``, or int8 with ``scales`` = (gate_up ``[E, 2 * inter]``, down
    ``[E, hidden]``) float32 row scales (``engine.moe.quantize_rows``). ``weights``/``experts``
    ``[tokens, top_k]``; a token's experts are distinct. Products accumulate in float32; gate, up,
    the activation and each expert's output are rounded to ``x.dtype`` as the torch path rounds
    them; the weighted slots are summed in float32 and rounded once. ``blocks``: ``(block_m,
    block_n, block_k)``, powers of two >= 16 (default :func:`_blocks`). On CPU tensors the
    kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported)."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = blocks or _blocks(tokens * top_k, x.dtype)
    if any(b < 16 or b & (b - 1) for b in (block_m, block_n, block_k)):
        raise ValueError(f"blocks must be powers of two >= 16, got {(block_m, block_n, block_k)}")
    from engine.kernels._triton_moe_kernels import dot_dtype, get_kernel

    interpret = use_interpreter(x, gate_up, down)
    al = align(experts, num_experts, block_m)
    act = torch.empty(al.num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(al.num_pairs, hidden, dtype=torch.float32, device=x.device)
    gs, ds = scales if scales is not None else (x, x)  # unread without HAS_SCALE
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_SCALE=scales is not None)
    common["DOT_PRECISION"] = "ieee" if x.dtype == torch.float32 else None  # fp32 without TF32
    common["DOT_DTYPE"] = dot_dtype(str(x.dtype).removeprefix("torch."), interpret)
    get_kernel("gate_up", interpret)[(al.num_blocks, -(-inter // block_n))](
        x, gate_up, gs, act, al.sorted_pairs, al.block_expert, al.num_pairs, hidden, inter,
        *x.stride(), *gate_up.stride(), *_scale_strides(gs, scales), *act.stride(),
        TOP_K=top_k, **common,
    )  # fmt: skip
    pair_w = weights.flatten().float().contiguous()
    get_kernel("down", interpret)[(al.num_blocks, -(-hidden // block_n))](
        act, down, ds, pair_w, out, al.sorted_pairs, al.block_expert, al.num_pairs, hidden, inter,
        *act.stride(), *down.stride(), *_scale_strides(ds, scales), *out.stride(),
        **common,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _scale_strides(scale: torch.Tensor, scales) -> tuple[int, int]:
    """The two strides of a ``[E, rows]`` scale tensor; zeros where there are no scales."""
    return tuple(scale.stride()) if scales is not None else (0, 0)
