"""Headroom for API keys under their share (issue 27), used by the router's admission stage.

Contract of :class:`FairHeadroom`: while two or more keys are *active* (a request of theirs
granted or queued, or one arrived within ``active_window_s``), a key whose grant would take it past
its share of the forwarding slots (capacity x its share / the active keys' shares) must leave
``slots()`` of them free (capped at capacity - 1, so an idle router always forwards). A key under
its share then finds a free place in a worker's batch and starts at once instead of waiting for a
heavy key's request to finish. With one active key nothing is kept back (work-conserving).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping


class FairHeadroom:
    """Slots kept free for keys under their share; ``slots()`` is read at each decision (it grows
    with the ready workers)."""

    def __init__(self, slots: Callable[[], int], active_window_s: float = 5.0) -> None:
        self.slots, self.active_window_s = slots, active_window_s
        self._last_arrival: dict[str, float] = {}

    def arrived(self, key: str, now: float) -> None:
        """A request of ``key`` arrived at ``now``: the key is active for ``active_window_s``."""
        self._last_arrival[key] = now

    def kept_from(self, key: str, slots: int, capacity: int, granted: Mapping[str, int], queued: Collection[str],
                  shares: Mapping[str, float], now: float) -> int:
        """Slots of ``capacity`` that a grant of ``slots`` to ``key`` must leave free at ``now`` (the
        caller's clock, the one ``arrived`` was given), given each key's ``granted`` slots, the keys
        with requests ``queued`` and the keys' ``shares``."""
        headroom = self.slots()
        if headroom <= 0:
            return 0
        active = self._active(granted, queued, now) | {key}
        if len(active) < 2:
            return 0
        share = capacity * shares[key] / sum(shares[k] for k in active)
        return min(headroom, capacity - 1) if granted.get(key, 0) + slots > share else 0

    def _active(self, granted: Mapping[str, int], queued: Collection[str], now: float) -> set[str]:
        horizon = now - self.active_window_s
        for k in [k for k, t in self._last_arrival.items() if t < horizon]:
            del self._last_arrival[k]
        return {k for k, n in granted.items() if n > 0} | set(queued) | set(self._last_arrival)


def default_fair_headroom(per_worker: int, max_running_requests: int) -> int:
    """The headroom per worker when ``--fair-headroom-per-worker`` is not given: enough that a key
    at its share keeps one place of each worker's batch free (the forwarding slots beyond the
    batch, plus one), 0 when the forwarding bound already stays below the batch."""
    return max(0, per_worker - max_running_requests + 1)
