"""A worker's live role switch, prefill <-> decode, its model weights kept loaded.

The worker loop (``server.worker.loop``) owns one ``RoleSwitcher``. On a ``SwitchRole`` from a
router, ``begin`` checks the switch and starts it: the worker takes nothing new (the router took it
out of rotation first) and empties itself; a decode worker moves its running and parked requests
to peer decode workers over the migration path (``decode_worker.evacuate``), a prefill worker
gives back the prompts whose KV it has not written (``prefill_worker.switch_away``: the router sends
them to another pair) and finishes its KV writes under way and its recomputes. ``before_turn`` runs the evacuation
or the hand-back each turn;
``after_turn`` sees the worker hold nothing (``held_rids``), retires the old scheduler (its radix
cache evicted, so every KV page is free again; its transports closed) and builds the new role's
scheduler over the same ``ModelRunner`` (``rebuild``): the pools are re-laid for the new role from
empty. The loop then serves the new scheduler under a new process ``instance`` (peers handshake
again: its transport is new) and answers ``RoleSwitched``. A switch not done within
``timeout_s`` is abandoned: the worker serves on in its old role and the answer says why.

Invariant: a scheduler is retired only when it holds no request and no write reads or fills its
pages; after ``retire`` the page allocator's free count equals its total.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.scheduler.base import WorkerScheduler
from transfer.wire.enums import Role
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import RoleSwitched

log = logging.getLogger(__name__)

SWITCHABLE = (Role.PREFILL, Role.DECODE)


@dataclass
class Pending:
    """The switch under way: where to, who asked (its control connection), since when."""

    role: Role
    requester: bytes
    started: float


class RoleSwitcher:
    """Drives one worker's role switches (module docstring). ``rebuild(role)`` builds a scheduler of
    ``role`` over the worker's runner; ``timeout_s``: the longest a switch may take to empty the worker."""

    def __init__(self, rebuild: Callable[[Role], WorkerScheduler], timeout_s: float, clock=time.monotonic) -> None:
        self.rebuild, self.timeout_s, self.clock = rebuild, timeout_s, clock
        self.pending: Pending | None = None

    def begin(self, s: WorkerScheduler, requester: bytes, role: Role) -> RoleSwitched | None:
        """Start switching ``s`` to ``role``; the refusal to answer at once, or None (under way)."""
        why = None
        if self.pending is not None:
            why = f"a switch to {self.pending.role} is under way"
        elif s.role not in SWITCHABLE or role not in SWITCHABLE:
            why = f"a {s.role} worker cannot become a {role} worker (prefill <-> decode only)"
        elif s.role == role:
            why = f"already a {role} worker"
        elif s.role == Role.DECODE:
            from decode_worker.evacuate import start

            why = start(s)
        if why is not None:
            return RoleSwitched(ok=False, role=s.role, error=why)
        self.pending = Pending(role, requester, self.clock())
        log.warning("switching role %s -> %s: taking nothing new, moving out what is held", s.role, role)
        return None

    def before_turn(self, s: WorkerScheduler) -> Outbox:
        """A decode worker's running requests leave its batch for migration; a prefill worker gives
        back the prompts whose KV it has not written (``prefill_worker.switch_away``). The messages to send."""
        if self.pending is None:
            return Outbox()
        if s.role == Role.DECODE:
            from decode_worker.evacuate import evacuate

            evacuate(s)
            return Outbox()
        from prefill_worker.switch_away import hand_back_unwritten

        return hand_back_unwritten(s)

    def after_turn(self, s: WorkerScheduler) -> tuple[WorkerScheduler, RoleSwitched, bytes] | None:
        """None while the switch goes on (or none is under way); else (the scheduler to serve with,
        the answer, whom to send it to): the new role's, or ``s`` itself when the switch timed out."""
        p = self.pending
        if p is None:
            return None
        held = s.held_rids()
        waited = self.clock() - p.started
        if held and waited <= self.timeout_s:
            return None
        self.pending = None
        if held:
            if s.role == Role.DECODE:
                from decode_worker.evacuate import stop

                stop(s)
            error = f"{len(held)} request(s) still held after {self.timeout_s:g}s; serving on as a {s.role} worker"
            log.error("role switch abandoned: %s", error)
            return s, RoleSwitched(ok=False, role=s.role, error=error, seconds=waited), p.requester
        retire(s)
        new = self.rebuild(p.role)
        seconds = self.clock() - p.started
        log.warning("switched role %s -> %s in %.3f s", s.role, p.role, seconds)
        return new, RoleSwitched(ok=True, role=p.role, seconds=seconds), p.requester


def retire(s: WorkerScheduler) -> None:
    """Give back everything an emptied scheduler holds: its radix cache's pages (every page is then
    free) and its transports. ``AssertionError`` if a page is still in use (a leak)."""
    kv = s.kv
    kv.evict(kv.allocator.num_pages)
    if kv.swa_allocator is not None and kv.tree is not None:
        kv.evict_swa(kv.swa_allocator.num_pages)
    s.check_integrity()
    assert kv.allocator.num_free() == kv.allocator.num_pages, "a retired scheduler holds KV pages"
    for closer in _closers(s):
        closer()


def _closers(s) -> list[Callable[[], None]]:
    """The close calls of ``s``'s transports and writer threads (decode: the receiving transport and
    the migration sender; prefill: its KV sender)."""
    out = []
    for sender in (getattr(s, "sender", None), getattr(getattr(s, "migration", None), "sender", None)):
        if sender is not None:
            out += [sender.close, sender.transport.close]
    transfers = getattr(s, "transfers", None)
    if transfers is not None:
        out.append(transfers.transport.close)
    return out
