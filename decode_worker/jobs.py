"""Decode-side state of one PD request on top of the shared ``Request``: ``DecodeState`` and its
checked transitions.

::

    QUEUED ------> AWAITING_KV ---> RUNNING ---> HOST_PARKED ---> RUNNING   (offload, resume)
      |                 ^           ^  |
      |                 |           |  v
      |                 +-----------|- RECOMPUTING                        (KV dropped; prefill again)
      |                             |
      +-----> LOCAL_PREFILL --------+           (selective disaggregation: this worker prefills it)

    HOST_PARKED ---> MIGRATING ---> FINISHED      (offered to a peer decode worker; KV written there)
                         |
                         +--------> HOST_PARKED   (declined, withdrawn, or the write failed)

    any state but FINISHED -> FINISHED (completion, abort, failure)

Each state maps to the shared ``Phase`` of ``req.status`` (``PHASE_OF``), which ``enter`` keeps in
step. Only the decode worker's lifecycle (``RetractManager``, ``TransferTracker``, the scheduler's
``finish`` and landing) moves a job: moving it along an edge not in ``TRANSITIONS`` raises
``IllegalTransition``. A host-parked job that waited too long may be offered to a peer decode
worker (MIGRATING, ``decode_worker.migration``): it leaves when the peer has its KV, or comes
back to HOST_PARKED. On the peer a migrated job starts QUEUED with ``migrated`` set, like a
recompute whose "prefill worker" is the source decode worker.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from cache.host_pool import HostKV
from engine.request import Phase, Request
from engine.scheduler.base import Outcome


class DecodeState(enum.StrEnum):
    """Where a PD request is on the decode worker."""

    QUEUED = "queued"  # arrived; waiting for pages before it asks for its KV
    AWAITING_KV = "awaiting_kv"  # pages reserved, a prefill worker writes the KV into them
    RUNNING = "running"  # in the decode batch
    HOST_PARKED = "host_parked"  # retracted: KV in the host pool, waiting in the retracted queue to resume
    RECOMPUTING = "recomputing"  # retracted: KV dropped, waiting for pages to have it prefilled again
    LOCAL_PREFILL = "local_prefill"  # prefilled by this decode worker itself (decode_worker.local_prefill)
    MIGRATING = "migrating"  # retracted, offered to (or being written to) a peer decode worker
    FINISHED = "finished"  # ended; its pages are freed (or cached)


TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    DecodeState.QUEUED: frozenset({DecodeState.AWAITING_KV, DecodeState.LOCAL_PREFILL}),
    DecodeState.LOCAL_PREFILL: frozenset({DecodeState.RUNNING}),
    DecodeState.AWAITING_KV: frozenset({DecodeState.RUNNING}),
    DecodeState.RUNNING: frozenset({DecodeState.HOST_PARKED, DecodeState.RECOMPUTING}),
    DecodeState.HOST_PARKED: frozenset({DecodeState.RUNNING, DecodeState.MIGRATING}),
    DecodeState.MIGRATING: frozenset({DecodeState.HOST_PARKED}),
    DecodeState.RECOMPUTING: frozenset({DecodeState.AWAITING_KV}),
    DecodeState.FINISHED: frozenset(),
}

PHASE_OF: dict[DecodeState, Phase] = {
    DecodeState.QUEUED: Phase.PREALLOC,
    DecodeState.AWAITING_KV: Phase.TRANSFER,
    DecodeState.RUNNING: Phase.RUNNING,
    DecodeState.HOST_PARKED: Phase.RETRACTED,
    DecodeState.MIGRATING: Phase.RETRACTED,
    DecodeState.RECOMPUTING: Phase.PREALLOC,
    DecodeState.LOCAL_PREFILL: Phase.WAITING,
    DecodeState.FINISHED: Phase.FINISHED,
}


class IllegalTransition(RuntimeError):
    """A decode job was moved along an edge its state machine does not have."""


def can_move(src: DecodeState, dst: DecodeState) -> bool:
    """Whether ``src -> dst`` is an edge: one of ``TRANSITIONS``, or to FINISHED from any live state."""
    return dst in TRANSITIONS[src] or (dst is DecodeState.FINISHED and src is not DecodeState.FINISHED)


@dataclass(eq=False)
class DecodeJob:
    """A PD request on the decode worker, in ``state`` (its ``req.status`` follows, ``PHASE_OF``).

    ``generation`` counts prefills of this request: 0 is the router's; each recompute after a
    retract whose KV could not be kept asks the prefill worker again with ``generation + 1`` for
    ``n_tokens = seq_len - 1`` tokens (prompt + output so far, minus the next input token).
    ``answered`` is set once the client got its last word (an abort): a job still in AWAITING_KV
    then keeps its pages (fenced since ``fenced_at``) until no remote write can land in them.
    """

    req: Request
    room: int
    prefill_addr: str
    generation: int = 0
    n_tokens: int = 0
    decode_prefix_len: int = 0
    host_kv: HostKV | None = None
    answered: Outcome | None = None
    fenced_at: float = 0.0
    state: DecodeState = DecodeState.QUEUED
    migrated: bool = False  # arrived from a peer decode worker (``prefill_addr`` is that worker's)
    write_posted: bool = False  # the writer said the KV write into its pages started (``KVWriteStarted``)
    parked_at: float = 0.0  # monotonic time it last entered HOST_PARKED
    parked_step: int = 0  # the decode worker's step count then
    preempt: bool = False  # ``GenerateRequest.preempt``: may displace a running job without it
    withdrawn: bool = False  # its prefill was asked back (``decode_worker.evacuate.release_unprefilled``)

    def __post_init__(self) -> None:
        self.req.status = PHASE_OF[self.state]

    @property
    def key(self) -> tuple[int, int]:
        return self.room, self.generation

    def enter(self, state: DecodeState) -> None:
        """Move to ``state`` (and ``req.status`` to its phase); ``IllegalTransition`` if there is no
        such edge. FINISHED leaves ``req.status`` to ``Request.finish`` (it records the reason)."""
        if not can_move(self.state, state):
            raise IllegalTransition(f"decode job {self.req.rid!r}: {self.state} -> {state}")
        self.state = state
        if state is DecodeState.HOST_PARKED:
            self.parked_at, self.parked_step = time.monotonic(), -1  # the step is stamped by the migration policy
        if state is not DecodeState.FINISHED:
            self.req.status = PHASE_OF[state]
