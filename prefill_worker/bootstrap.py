"""Destinations that arrive before their prompt.

The router sends a request's ``PrefillRequest`` to the prefill worker and its ``GenerateRequest`` to
the decode worker at the same time, over different connections; the decode worker's
``KVDestination`` can therefore reach the prefill worker first. Such an early destination is parked
here until its ``PrefillRequest`` arrives (``claim``), or answered with ``PrefillFailed`` after
``GRACE_S`` (``expired``): the prompt takes the direct path, so one that is seconds behind its
destination is lost, not late, and the decode side must get its pages back soon. A destination for a
request this worker already ended is refused at once (``gone``, ``refusal``): it remembers the last
``keep`` ended rooms and why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from prefill_worker.switch_away import SWITCHING_AWAY
from transfer.wire.outbox import Conn
from transfer.wire.protocol import KVDestination, PrefillFailed

Key = tuple[int, int]  # (room, generation)
GRACE_S = 5.0
WITHDRAWN = "prefilled by its decode worker"  # ``ended`` reason of a ``PrefillWithdrawn`` room


@dataclass
class EarlyDestination:
    source: Conn
    msg: KVDestination
    pages: tuple[np.ndarray, np.ndarray]  # (full pages, SWA pages) of the KVDestination frames
    at: float = field(default_factory=time.monotonic)


class BootstrapTable:
    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self.early: dict[Key, EarlyDestination] = {}
        self._ended: dict[Key, str] = {}

    def park(self, key: Key, dest: EarlyDestination) -> None:
        self.early[key] = dest

    def claim(self, key: Key) -> EarlyDestination | None:
        """The destination that came before this key's ``PrefillRequest``, if any."""
        return self.early.pop(key, None)

    def ended(self, key: Key, why: str) -> None:
        """Remember that ``key`` ended (oldest forgotten beyond ``keep``)."""
        self._ended[key] = why
        if len(self._ended) > self.keep:
            del self._ended[next(iter(self._ended))]

    def gone(self, key: Key) -> str | None:
        """Why ``key`` ended here, or None if it never did (as far as this table remembers)."""
        return self._ended.get(key)

    def expired(self) -> list[EarlyDestination]:
        """Parked destinations older than ``GRACE_S``, removed."""
        now = time.monotonic()
        old = [k for k, d in self.early.items() if now - d.at > GRACE_S]
        return [self.early.pop(k) for k in old]

    def next_deadline(self) -> float | None:
        """Monotonic time at which the oldest parked destination expires."""
        oldest = min((d.at for d in self.early.values()), default=None)
        return None if oldest is None else oldest + GRACE_S


def refusal(msg: KVDestination, why: str) -> PrefillFailed:
    """The answer to ``msg``, a destination for a request that ended here (``why``): nothing will be
    written. One for a prompt a switching prefill worker gave back (``prefill_worker.switch_away``)
    is marked handed back, as that prompt's own ``PrefillFailed`` was."""
    back = why == SWITCHING_AWAY
    error = f"prefill worker has no such request any more ({why})"
    return PrefillFailed(
        rid=msg.rid,
        room=msg.room,
        generation=msg.generation,
        error=error,
        error_status=503 if back else 500,
        handed_back=back,
    )
