"""Backend selection shared by the kernel entry points.

Nothing here imports triton at module import time: ``engine`` must stay importable (and
``TRITON_INTERPRET`` settable by tests) before triton is loaded.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (the result is cached for the process)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def interpret_requested() -> bool:
    """True when the environment asks for the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Pick ``"triton"`` or ``"torch"`` for a call on ``tensors``.

    ``backend``: ``None``/``"auto"`` -> Triton when every tensor is on CUDA and triton imports,
    else torch; ``"torch"`` -> torch; ``"triton"`` -> Triton (raises if triton is missing). A
    forced Triton call on CPU tensors runs under the Triton interpreter (see ``use_interpreter``).
    """
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not importable")
        return "triton"
    if all(t.is_cuda for t in tensors) and triton_available():
        return "triton"
    return "torch"


def use_interpreter(*tensors: torch.Tensor) -> bool:
    """Run Triton kernels in the interpreter: requested by env, or any tensor is not on CUDA."""
    return interpret_requested() or not all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()
