"""Headroom for API keys under their share, used by the router's admission stage
(``docs/operate/overload.md``).

Contract of :class:`FairHeadroom`: while two or more keys are *active* (a request of theirs
granted or queued, or one arrived within ``active_window_s``), a key whose grant would take it past
its share of the forwarding slots (capacity x its share / the active keys' shares) must leave
``slots()`` of them free (capped at capacity - 1, so an idle router always forwards). A key under
its share then finds a free place in a worker's batch and starts at once instead of waiting for a
heavy key's request to finish. With one active key nothing is kept back (work-conserving).

``under_share``: whether, while another key is active, a grant leaves a key below another active
key, in slots held or in service lately (``served``: work granted per second over the last
seconds, below ``SERVICE_GAP`` times the other's), both per unit of share: a light key whose
requests last long needs more than its share of the slots for less than its share of the service,
and gets them. Being within its own share is not enough: while a heavy key ramps up its grants are
within its share too, and marked they filled a decode batch with requests nobody could preempt and
stood in the decode worker's queue before the light key's (seen: 150-400 ms of the light key's
TTFT in the first seconds of a heavy burst). Service counts at the grant, not at the finish:
a heavy key that has just arrived and filled the slots has finished nothing yet, and counted by
finishes it would look starved, go past the slots and displace the light key's requests (seen);
slots held cover the seconds in which a heavy key's service is still ramping up.
With ``preempt`` on (PD: decode workers retract for such requests, ``GenerateRequest.preempt``)
such a grant is made even when every forwarding slot is taken, within twice the slots (the
caller's bound); two keys served alike grant nothing past the slots.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Mapping

from server.router.drain_rate import DrainRate

SERVICE_GAP = 0.8  # served below this fraction of another key's (per unit of share): under its share


class FairHeadroom:
    """Slots kept free for keys under their share; ``slots()`` is read at each decision (it grows
    with the ready workers)."""

    def __init__(self, slots: Callable[[], int], active_window_s: float = 5.0, preempt: bool = False) -> None:
        """``preempt``: grants under a key's share go past the forwarding bound (module docstring)."""
        self.slots, self.active_window_s, self.preempt = slots, active_window_s, preempt
        self._last_arrival: dict[str, float] = {}
        self._served: defaultdict[str, DrainRate] = defaultdict(lambda: DrainRate(5.0))  # work granted per key

    def granted(self, key: str, tokens: int, now: float) -> None:
        """A request of ``key`` with ``tokens`` of work (prompt + max_tokens) was granted at ``now``.
        A key granted nothing for a whole window starts measuring afresh (over at least a second):
        one that comes back after an idle spell must not look starved while its first grants go out."""
        rate = self._served[key]
        if rate.idle_since(now):
            rate = self._served[key] = DrainRate(rate.window_s)
        rate.start(now)
        rate.record(now, tokens)

    def served(self, key: str, now: float) -> float:
        """Work granted to ``key`` per second lately (0 before any grant)."""
        rate = self._served.get(key)
        return (rate.tokens_per_s(now) or 0.0) if rate is not None else 0.0

    def arrived(self, key: str, now: float) -> None:
        """A request of ``key`` arrived at ``now``: the key is active for ``active_window_s``."""
        self._last_arrival[key] = now

    def kept_from(
        self,
        key: str,
        slots: int,
        capacity: int,
        granted: Mapping[str, int],
        queued: Collection[str],
        shares: Mapping[str, float],
        now: float,
    ) -> int:
        """Slots of ``capacity`` that a grant of ``slots`` to ``key`` must leave free at ``now`` (the
        caller's clock, the one ``arrived`` was given), given each key's ``granted`` slots, the keys
        with requests ``queued`` and the keys' ``shares``."""
        headroom = self.slots()
        if headroom <= 0:
            return 0
        share = self._share(key, capacity, granted, queued, shares, now)
        return min(headroom, capacity - 1) if share is not None and granted.get(key, 0) + slots > share else 0

    def under_share(
        self,
        key: str,
        slots: int,
        capacity: int,
        granted: Mapping[str, int],
        queued: Collection[str],
        shares: Mapping[str, float],
        now: float,
    ) -> bool:
        """True when another key is active and a grant of ``slots`` to ``key`` leaves it below another
        active key per unit of share: in slots held after the grant, or in ``served`` (work granted
        lately, tokens per second; ``granted`` records it) below ``SERVICE_GAP`` times the other's;
        arguments as ``kept_from``."""
        others = self._active(granted, queued, now) - {key}  # empty: no other key active
        held = granted.get(key, 0) + slots
        mine, w = self.served(key, now) / shares[key], shares[key]
        return any(
            held / w < granted.get(k, 0) / shares[k] or mine < SERVICE_GAP * self.served(k, now) / shares[k]
            for k in others
        )

    def _share(
        self,
        key: str,
        capacity: int,
        granted: Mapping[str, int],
        queued: Collection[str],
        shares: Mapping[str, float],
        now: float,
    ) -> float | None:
        """``key``'s share of ``capacity`` among the active keys; None with fewer than two active."""
        active = self._active(granted, queued, now) | {key}
        if len(active) < 2:
            return None
        return capacity * shares[key] / sum(shares[k] for k in active)

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
