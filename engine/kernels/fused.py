"""Fused per-layer ops: RMSNorm (optionally with the residual add; with a float32 scale), rotary in place,
SiLU- and GELU-tanh-and-multiply.

Each function takes the C kernel (``cpu_fused.c`` through ``cpu_native``) for CPU float32/bfloat16
tensors in the layouts it reads, and the torch reference (``*_ref``, the model's original
expressions) otherwise: CUDA, float16, odd strides, or no compiler. Both compute in float32 and
round to the input dtype once; they agree to float32 rounding (tests/engine/test_fused_ops.py).
``PDSERVE_NATIVE_KERNELS=0`` forces the references, as for the attention kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cpu_native

# Elements from which an op's rows are split over torch's OpenMP threads (the kernels share torch's
# runtime, so a parallel region costs microseconds; below this one thread is faster).
PARALLEL_ELEMENTS = 1 << 15


def _threads(elements: int) -> int:
    if elements < PARALLEL_ELEMENTS or not cpu_native.openmp_shared():
        return 1
    return torch.get_num_threads()


def _native(*tensors: torch.Tensor):
    """The library when every tensor is a CPU float32/bfloat16 one of one dtype, else None."""
    t0 = tensors[0]
    if t0.device.type != "cpu" or t0.dtype not in cpu_native.DTYPES:
        return None
    if any(t.device.type != "cpu" or t.dtype != t0.dtype for t in tensors[1:]):
        return None
    return cpu_native.load()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape; its rows may be strided, the last dim
    contiguous), scaled by ``weight``; a new contiguous tensor in ``x``'s dtype."""
    lib = _native(x, weight)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    flat_ok = x.dim() >= 1 and x.stride(-1) == 1 and weight.is_contiguous() and rows > 0
    if lib is None or not flat_ok or (x.dim() > 2 and not x.is_contiguous()):
        return rms_norm_ref(x, weight, eps)
    row_stride = x.stride(-2) if x.dim() >= 2 else dim
    return _norm_rows(lib.pdserve_rms_norm, x, row_stride if x.dim() == 2 else dim, weight, eps)


def _norm_rows(entry, x: torch.Tensor, row_stride: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A new contiguous tensor of ``x``'s shape and dtype: C norm kernel ``entry`` over ``x``'s rows of the
    last dim, ``row_stride`` elements apart, times ``weight``."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    entry(
        x.data_ptr(),
        row_stride,
        weight.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
        int(x.dtype == torch.bfloat16),
        _threads(x.numel()),
    )
    return out


def rms_norm_f32w_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * scale).to(x.dtype)


def rms_norm_f32w(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` times a float32 ``scale`` ``[dim]`` whatever ``x``'s dtype (Gemma's
    ``1 + weight``, which bfloat16 cannot hold); a new contiguous tensor in ``x``'s dtype. A strided ``x``
    is copied first (its rows are normed alone, so the result is the same)."""
    lib = _native(x)
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    if lib is None or scale.dtype != torch.float32 or not scale.is_contiguous() or rows == 0:
        return rms_norm_f32w_ref(x, scale, eps)
    return _norm_rows(lib.pdserve_rms_norm_f32w, x.contiguous(), dim, scale, eps)


def add_rms_norm(
    h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + residual, rms_norm(h + residual))``. On the kernel path ``h`` is updated in place and
    returned (callers pass a residual stream they own); the reference returns a new sum."""
    lib = _native(h, residual, weight)
    if lib is None or not (
        h.is_contiguous()
        and residual.is_contiguous()
        and weight.is_contiguous()
        and h.shape == residual.shape
        and h.numel()
    ):
        s = h + residual
        return s, rms_norm_ref(s, weight, eps)
    dim = h.shape[-1]
    out = torch.empty_like(h)
    lib.pdserve_add_rms_norm(
        h.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        h.numel() // dim,
        dim,
        eps,
        int(h.dtype == torch.bfloat16),
        _threads(h.numel()),
    )
    return h, out


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, check: bool = True
) -> torch.Tensor:
    """``x`` ``[tokens, heads, head_dim]`` rotated by ``positions`` (rotate_half convention; ``cos``/
    ``sin`` float32 ``[max_positions, head_dim]``). The kernel path rotates ``x`` in place (heads and
    head_dim contiguous, tokens strided: a view of a fused QKV row is fine) and returns it; the
    caller must not need the unrotated values. ``check=False``: the caller already checked these
    positions against the table (the kernel reads the table at them unchecked)."""
    lib = _native(x)
    ok = (
        lib is not None
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and x.shape[0] == positions.numel()
    )
    if not ok or x.shape[0] == 0:
        return rope_ref(x, positions, cos, sin)
    if check and (int(positions.min()) < 0 or int(positions.max()) >= cos.shape[0]):
        raise IndexError(f"rotary position outside 0..{cos.shape[0] - 1}")
    lib.pdserve_rope(
        x.data_ptr(),
        x.stride(0),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.shape[2],
        int(x.dtype == torch.bfloat16),
        _threads(x.numel()),
    )
    return x


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * inter]`` (gate first): ``[rows, inter]``."""
    return _gated_mul(gate_up, silu_mul_ref, "pdserve_silu_mul")


def _gated_mul(gate_up: torch.Tensor, ref, entry: str) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up`` ``[rows, 2 * inter]`` by C kernel ``entry``, or by ``ref`` where the
    kernel does not take it (no library, not a contiguous 2-D tensor of even width)."""
    lib = _native(gate_up)
    if lib is None or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        return ref(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    if rows:
        getattr(lib, entry)(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            inter,
            int(gate_up.dtype == torch.bfloat16),
            _threads(gate_up.numel()),
        )
    return out


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of ``gate_up`` ``[rows, 2 * inter]`` (gate first):
    ``[rows, inter]`` (Gemma's MLP)."""
    return _gated_mul(gate_up, gelu_tanh_mul_ref, "pdserve_gelu_tanh_mul")


def store_kv(buffer: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write ``k``/``v`` ``[tokens, heads, dim]`` into slots ``slots`` (int64, already checked to be
    inside the pool) of ``layer`` of a ``[pages, layers, 2, P, heads, dim]`` pool ``buffer``, in
    place. Returns False (nothing written) where the kernel does not apply: the caller then stores
    with torch. Rows of ``k``/``v`` may be strided (views of a fused QKV row); each row contiguous."""
    lib = _native(buffer, k, v)
    if (
        lib is None
        or k.dim() != 3
        or v.dim() != 3
        or k.shape != v.shape
        or k.shape[1:] != buffer.shape[4:]
        or not buffer.is_contiguous()
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or k.stride(2) != 1
        or k.stride(1) != k.shape[2]
        or v.stride(2) != 1
        or v.stride(1) != v.shape[2]
        or slots.numel() != k.shape[0]
    ):
        return False
    s = buffer.stride()
    base = buffer.data_ptr() + layer * s[1] * buffer.element_size()
    lib.pdserve_store_kv(
        base,
        s[0],
        s[2],
        s[3],
        buffer.shape[3],
        slots.data_ptr(),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k.shape[0],
        k.shape[1] * k.shape[2],
        buffer.element_size(),
    )
    return True
