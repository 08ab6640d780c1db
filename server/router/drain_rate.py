"""Work finished (or granted) per second over a sliding window: the router admission's drain rate
and the per-key service that fair headroom compares."""

from __future__ import annotations

from collections import deque


class DrainRate:
    """Work (tokens) finished per second over the last ``window_s`` seconds; None until measured."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._done: deque[tuple[float, int]] = deque()
        self._since: float | None = None

    def start(self, now: float) -> None:
        """Work began flowing at ``now`` (the first grant); the rate is measured from there."""
        if self._since is None:
            self._since = now

    def record(self, now: float, tokens: int) -> None:
        """A request of ``tokens`` work finished at ``now``."""
        self._done.append((now, tokens))
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()

    def idle_since(self, now: float) -> bool:
        """True when nothing was recorded within the window before ``now`` (or ever)."""
        return not self._done or self._done[-1][0] < now - self.window_s

    def tokens_per_s(self, now: float) -> float | None:
        """The measured rate, or None when nothing finished in the window."""
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
        if not self._done or self._since is None:
            return None
        span = max(1.0, min(self.window_s, now - self._since))
        return sum(t for _, t in self._done) / span
