"""A worker's drain: the decision of when a draining worker may exit.

Draining starts on SIGTERM or a ``Drain`` message. From then on the worker reports
``draining=True`` in its ``WorkerStats`` (routers stop routing to it at once) and finishes what it
holds. It exits once both hold: it holds no request, and no new request arrived for ``quiet_s``
(a router that sent one before it saw the flag may still have more in flight; ``quiet_s`` is a few
heartbeat periods, time for every router to see the flag), and none was held for ``quiet_s``
(routers saw it empty: their view of its pages is current when it leaves). SIGUSR1 drains without the
quiet period: its launcher stops the whole cluster, router first. Past ``timeout_s`` it gives up: the
requests still held are failed with 503 (a router sends again, on another worker, a request that
had no token yet) and it exits.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from transfer.wire.outbox import Outbound, Outbox
from transfer.wire.protocol import PrefillFailed

log = logging.getLogger(__name__)


class HoldsRequests(Protocol):
    """What a drain asks of a scheduler (every ``WorkerScheduler`` of this repo has it)."""

    def held_rids(self) -> set[str]:
        """Ids of every request the worker holds (queued, running, retracted, waiting on a
        transfer): what a drain waits for, and what it fails when it runs out of time."""


class Verdict(enum.Enum):
    """What the loop does after this turn: go on, exit (drained), or fail what is left and exit."""

    SERVE = "serve"
    EXIT = "exit"
    EXPIRED = "expired"


@dataclass
class Drain:
    """Drain bookkeeping of one worker (monotonic seconds from ``clock``); no sockets, no threads."""

    timeout_s: float
    quiet_s: float
    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    reason: str = ""
    last_intake: float = 0.0
    idle_since: float | None = None  # since when it holds no request (None: it holds some)

    @property
    def active(self) -> bool:
        """Whether the worker is draining."""
        return self.started is not None

    def begin(self, reason: str, quiet_s: float | None = None) -> bool:
        """Start draining (idempotent); True when this call started it. ``quiet_s`` replaces the
        quiet period (also when already draining): 0 when no router can still be routing here."""
        if quiet_s is not None:
            self.quiet_s = quiet_s
        if self.started is not None:
            return False
        self.started = self.last_intake = self.clock()
        self.reason = reason
        log.warning(
            "draining (%s): taking no new requests, finishing the ones held within %.0fs", reason, self.timeout_s
        )
        return True

    def took_request(self) -> None:
        """A new request arrived while draining (a router had not seen the flag yet): it is served,
        and the quiet period starts again."""
        if self.started is not None:
            self.last_intake = self.clock()

    def verdict(self, holding: int) -> Verdict:
        """The loop's next move while the worker holds ``holding`` requests."""
        if self.started is None:
            return Verdict.SERVE
        now = self.clock()
        if holding:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        if holding == 0 and now - max(self.last_intake, self.idle_since) >= self.quiet_s:
            return Verdict.EXIT
        if now - self.started >= self.timeout_s:
            return Verdict.EXPIRED
        return Verdict.SERVE

    def expired_error(self) -> str:
        """The error of a request failed because the drain ran out of time."""
        return (
            f"the worker was draining ({self.reason}) and did not finish this request within "
            f"drain_timeout_s={self.timeout_s:g}s"
        )


def as_unavailable(out: Outbox, error: str) -> Outbox:
    """``out`` with every failed delta (and ``PrefillFailed`` to a decode peer) turned into a 503
    carrying ``error`` (requests a drain ended: the worker went away, which is what 503 tells a
    router; aborts say 499 otherwise)."""
    fixed = Outbox()
    fixed.messages = [
        Outbound(m.to, m.msg.model_copy(update={"error": error, "error_status": 503}), m.frames)
        if isinstance(m.msg, PrefillFailed)
        else m
        for m in out.messages
    ]
    for owner, delta in out.tokens:
        if delta.finish_reason == "abort":
            delta = delta.model_copy(update={"error": error, "error_status": 503})
        fixed.token(owner, delta)
    return fixed
