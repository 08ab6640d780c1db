"""Prefill chunks sized by time: a step's prefill tokens are cut so the step takes about ``step_s``.

A worker reads its control messages (a role switch, a drain, an abort, a withdrawal) between two of
its steps, so the longest step is how long they wait. A chunk of ``chunked_prefill_size`` tokens is
short on an accelerator but not on a small or shared CPU: 512 tokens of the embedded model took
15 s on a 2-core host under load, and a role switch waited for it. ``ChunkPace`` keeps the rate of
the recent prefill steps (rows per second, a step's prefill tokens plus its decode rows, an
exponential average) and gives the next step ``rate * step_s`` rows, less its decode rows, rounded
down to a multiple of ``min_tokens`` and never below it (a prompt always advances), never above
the token cap the caller has (``chunked_prefill_size``, or what a mixed step leaves). Before the
first measurement a step gets ``probe_tokens``: an unmeasured host may be slow.

On a forward whose cost is about linear in its rows (a CPU) the fixed part of a step is what a
smaller chunk adds; the rate then measures it too, and chunks settle where a step takes
``step_s``. Chunk boundaries do not change the output: every chunk attends to the pages of the
ones before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PROBE_TOKENS = 64  # the first chunk, before any step was timed
MIN_TOKENS = 16  # the smallest chunk, and the multiple chunks are rounded down to
RATE_WEIGHT = 0.5  # weight of the latest step in the average rate (a shared host's load moves fast)


@dataclass
class ChunkPace:
    """The prefill token budget of the next step (``tokens``) from the timed steps so far
    (``observe``, or ``timing`` around a forward). ``step_s`` 0: off, every step gets its cap.
    ``rate``: rows per second, None until a step with prefill was timed. ``clock``: what
    ``timing`` reads (a test's simulated host sets its own)."""

    step_s: float
    min_tokens: int = MIN_TOKENS
    probe_tokens: int = PROBE_TOKENS
    rate: float | None = None
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def tokens(self, cap: int, rows: int) -> int:
        """Prefill tokens for a step with ``rows`` decode rows whose token cap is ``cap``."""
        if self.step_s <= 0 or cap <= 0:
            return cap
        if self.rate is None:
            return min(cap, self.probe_tokens)
        fit = int(self.rate * self.step_s) - rows
        return min(cap, max(self.min_tokens, fit // self.min_tokens * self.min_tokens))

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        """A step computed ``tokens`` prefill tokens beside ``rows`` decode rows in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = (tokens + rows) / seconds
        self.rate = rate if self.rate is None else RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.rate

    @contextmanager
    def timing(self, tokens: int, rows: int) -> Iterator[None]:
        """Times the forward run inside it (``tokens`` prefill tokens beside ``rows`` decode rows,
        by ``clock``) and ``observe``s it: the pace of the next chunks."""
        t0 = self.clock()
        yield
        self.observe(tokens, rows, self.clock() - t0)
