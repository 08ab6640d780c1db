"""Prefill chunks sized by time: a step's prefill tokens are cut so the step takes about ``step_s``,
unless a step that short would spend most of its time on the forward's fixed cost.

A worker reads its control messages (a role switch, a drain, an abort, a withdrawal) between two of
its steps, so the longest step is how long they wait. A chunk of ``chunked_prefill_size`` tokens is
short on an accelerator but not on a small or shared CPU: 512 tokens of the embedded model took
15 s on a 2-core host under load, and a role switch waited for it.

The cost model. A step of ``n`` rows (its prefill tokens plus its decode rows) takes
``t(n) = F + c * n``: ``F`` the fixed part (every weight read once, the Python around the forward),
``c`` the time of one row. ``ChunkPace`` fits ``F`` and ``c`` to the last ``WINDOW`` timed steps by
least squares, each step weighing ``DECAY`` times the one after it (a shared host's load moves fast).
The fit needs steps of different sizes: where the window's sizes are too alike to tell ``F`` from
``c`` (a prompt cut into equal chunks), the fitted line keeps its shape and is scaled to the
window's times (a load change slows both parts alike); before any fit (the steps so far of one size)
``F`` is taken as 0 and the next chunk is of another size, so the step after it can be fitted. A
step ``DRIFT`` times slower or faster than the fit says drops the older steps (the load changed):
the line is scaled to that step, and the next chunk, if the model gives that step's size again, is
twice it (half where twice is past the cap), a second size to fit the new load by.

The contract of ``tokens(cap, rows)`` (``step_s`` > 0, ``cap`` > 0):

- before any step was timed: ``probe_tokens`` (an unmeasured host may be slow);
- else the rows that fit ``step_s`` (``F + c * n = step_s``), less ``rows``, rounded down to a
  multiple of ``min_tokens``, but never fewer than the rows at which the fixed part is at most half
  of a step (``n >= F / c``: at least 50% of a step computes rows), less ``rows``, rounded up to a
  multiple of ``min_tokens``; never below ``min_tokens`` (a prompt always advances);
- and never above ``cap`` (``chunked_prefill_size``, or what a mixed step leaves), whatever else.

So where ``F`` is small, chunks settle where a step takes ``step_s``; where ``F`` is large (a loaded
CPU), chunks stay at ``F / c`` rows or more and a step takes ``2 * F`` or longer, past ``step_s``:
the control messages wait that long, and prefill keeps at least half of its throughput. A fast host
keeps chunks of ``cap``. Chunk boundaries do not change the output: every chunk attends to the pages
of the ones before it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PROBE_TOKENS = 64  # the first chunk, before any step was timed
MIN_TOKENS = 16  # the smallest chunk, and the multiple chunks are rounded to
WINDOW = 12  # the timed steps the cost model is fitted to
DECAY = 0.75  # weight of a step against the one after it
DRIFT = 1.5  # a step this many times slower or faster than fitted: the load changed, older steps are dropped
SPREAD = 0.1  # least spread of the window's sizes (weighted deviation over mean) that separates F from c


@dataclass
class ChunkPace:
    """The prefill token budget of the next step (``tokens``) from the timed steps so far
    (``observe``, or ``timing`` around a forward). ``step_s`` 0: off, every step gets its cap.
    ``fixed_s``, ``row_s``: the fitted ``F`` and ``c`` of a step's time ``F + c * rows`` (``row_s``
    None until steps of two sizes were timed). ``steps``: the window, (rows, seconds), oldest first.
    ``clock``: what ``timing`` reads (a test's simulated host sets its own)."""

    step_s: float
    min_tokens: int = MIN_TOKENS
    probe_tokens: int = PROBE_TOKENS
    fixed_s: float = 0.0
    row_s: float | None = None
    steps: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def tokens(self, cap: int, rows: int) -> int:
        """Prefill tokens for a step with ``rows`` decode rows whose token cap is ``cap``."""
        if self.step_s <= 0 or cap <= 0:
            return cap
        if not self.steps:
            return min(cap, self.probe_tokens)
        m = self.min_tokens
        if self.row_s is None:  # no fit yet: the latest step's rate
            n, t = self.steps[-1]
            chunk = max(m, (int(n / t * self.step_s) - rows) // m * m)
        else:
            fit = (self.step_s - self.fixed_s) / self.row_s - rows
            efficient = self.fixed_s / self.row_s - rows
            if max(fit, efficient) >= cap:
                return cap
            chunk = max(m, int(fit + 1e-9) // m * m, math.ceil(efficient / m - 1e-9) * m)  # 1e-9: float error
        if len(self.steps) == 1 and chunk + rows == self.steps[0][0]:  # a second size, to tell F from c
            chunk = 2 * chunk if 2 * chunk <= cap else chunk // 2 // m * m or m
        return min(cap, chunk)

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        """A step computed ``tokens`` prefill tokens beside ``rows`` decode rows in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        n = tokens + rows
        if self.row_s is not None and not 1 / DRIFT <= seconds / (self.fixed_s + self.row_s * n) <= DRIFT:
            self.steps.clear()  # the load changed: the older steps mislead the fit
        self.steps.append((n, seconds))
        self._fit()

    def _fit(self) -> None:
        """``fixed_s`` and ``row_s`` from the window: least squares where its sizes differ enough,
        else the fitted line scaled to its times (kept None before any fit)."""
        w = [DECAY**age for age in range(len(self.steps) - 1, -1, -1)]
        total = sum(w)
        n_mean = sum(wi * n for wi, (n, _) in zip(w, self.steps, strict=True)) / total
        t_mean = sum(wi * t for wi, (_, t) in zip(w, self.steps, strict=True)) / total
        snn = sum(wi * (n - n_mean) ** 2 for wi, (n, _) in zip(w, self.steps, strict=True))
        snt = sum(wi * (n - n_mean) * (t - t_mean) for wi, (n, t) in zip(w, self.steps, strict=True))
        if snn >= (SPREAD * n_mean) ** 2 * total and snt > 0:
            row = snt / snn
            fixed = t_mean - row * n_mean
            if fixed < 0:  # no fixed part: the line through the origin
                fixed = 0.0
                row = sum(wi * n * t for wi, (n, t) in zip(w, self.steps, strict=True))
                row /= sum(wi * n * n for wi, (n, _) in zip(w, self.steps, strict=True))
            self.fixed_s, self.row_s = fixed, row
        elif self.row_s is not None:
            scale = t_mean / (self.fixed_s + self.row_s * n_mean)
            self.fixed_s, self.row_s = self.fixed_s * scale, self.row_s * scale

    @contextmanager
    def timing(self, tokens: int, rows: int) -> Iterator[None]:
        """Times the forward run inside it (``tokens`` prefill tokens beside ``rows`` decode rows,
        by ``clock``) and ``observe``s it: the pace of the next chunks."""
        t0 = self.clock()
        yield
        self.observe(tokens, rows, self.clock() - t0)
