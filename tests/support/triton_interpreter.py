"""The skip mark for tests of the Triton kernels in the interpreter on CPU.

The test module sets ``TRITON_INTERPRET=1`` before triton is first imported (the interpreter is chosen
at import); ``needs_triton`` skips its tests where triton is missing or was imported before that.
"""

from __future__ import annotations

import pytest

from engine.kernels import triton_available


def _skip_reason() -> str | None:
    if not triton_available():
        return "triton is not importable"
    from engine.kernels._triton_kernels import interpreter_usable

    if not interpreter_usable():
        return "triton was imported before TRITON_INTERPRET=1 was set (interpreter unavailable)"
    return None


SKIP_REASON = _skip_reason()
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")
