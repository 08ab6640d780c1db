"""The router's in-flight table: every request between submission and its last token or error.

Each entry owns an ``asyncio.Queue`` of ``TokenDelta``s fed by the workers' receive tasks (and, for
a queued move, one ``Moved`` marker). An entry names the workers that hold state for it
(``workers``; in PD mode a prefill and a decode worker) and the one whose token stream is forwarded
(``stream_from``); errors from any of its workers are forwarded too. ``fail_worker`` ends every
entry that touches a dead worker. Once tokens arrive from the streaming worker the others are done
with the request (in PD mode the KV has landed on the decode worker, which reports any later need of
a prefill worker, e.g. a recompute, itself): from then on only the streaming worker's death fails
it.

``prefill``: where the request's prompt is expected to be computed and how many of its tokens that
worker's cache did not hold when it was routed (the routing policy's estimate, ``Route.prefill``);
it counts in ``pending_prefill_tokens`` until the streaming worker's first token shows the prompt
was computed, so cache-aware routing weighs each worker's queued prefill work in tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from transfer.wire.protocol import TokenDelta


@dataclass(frozen=True)
class Moved:
    """Queued in an entry instead of a delta: the request, not prefilled yet, goes to decode worker
    ``target`` (its decode worker offered it: ``decode_worker.queued_moves``); the session sends it
    there under a new request id."""

    target: str


@dataclass
class Inflight:
    """One request in flight. ``cost`` (prompt + max new tokens) feeds the routing policy."""

    rid: str
    workers: tuple[str, ...]
    stream_from: str
    cost: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    depends_on: tuple[str, ...] = ()  # whose death fails it: ``workers``, then only ``stream_from``
    prefill: tuple[str, int] | None = None  # (worker, uncached prompt tokens) until the first token
    streamed: bool = False  # tokens came from the streaming worker
    prefilled_locally: bool = False  # the streaming decode worker computes the prompt (``PrefilledLocally``)
    continuation: bool = False  # a failed-over stream: prompt + the tokens sent before the failure

    def __post_init__(self) -> None:
        self.depends_on = self.depends_on or self.workers


class InflightTable:
    """rid -> ``Inflight``; all methods are synchronous and must run on the event loop thread."""

    def __init__(self) -> None:
        self._entries: dict[str, Inflight] = {}

    def open(
        self,
        rid: str,
        workers: tuple[str, ...],
        stream_from: str,
        cost: int,
        prefill: tuple[str, int] | None = None,
        continuation: bool = False,
    ) -> Inflight:
        """Register a request (``prefill``: see the module docstring; ``continuation``: a failed-over
        stream); raises ``KeyError`` if ``rid`` is already in flight."""
        if rid in self._entries:
            raise KeyError(f"request id {rid!r} is already in flight")
        entry = Inflight(rid, workers, stream_from, cost, prefill=prefill, continuation=continuation)
        self._entries[rid] = entry
        return entry

    def close(self, rid: str) -> None:
        """Forget a request (idempotent)."""
        self._entries.pop(rid, None)

    def dispatch(self, worker_id: str, delta: TokenDelta) -> bool:
        """Queue a worker's token delta for its request; False if nobody waits for it."""
        inflight = self._entries.get(delta.rid)
        if inflight is None or worker_id not in inflight.workers:
            return False
        if worker_id != inflight.stream_from and delta.error is None:
            return False
        if worker_id == inflight.stream_from and delta.token_ids:
            inflight.depends_on = (worker_id,)
            inflight.prefill = None
            inflight.streamed = True
        inflight.queue.put_nowait(delta)
        return True

    def fail_worker(self, worker_id: str, status: int, message: str) -> list[str]:
        """End every request that involves ``worker_id`` with an error; returns their rids."""
        rids = [rid for rid, e in self._entries.items() if worker_id in e.depends_on]
        for rid in rids:
            self._entries[rid].queue.put_nowait(TokenDelta.failed(rid, message, status))
        return rids

    def fail(self, rid: str, status: int, message: str) -> bool:
        """End ``rid`` with an error (whoever streams it); whether it was in flight."""
        e = self._entries.get(rid)
        if e is not None:
            e.queue.put_nowait(TokenDelta.failed(rid, message, status))
        return e is not None

    def entry(self, rid: str) -> Inflight | None:
        """The entry of ``rid``, or None if it is not in flight."""
        return self._entries.get(rid)

    def repoint(self, rid: str, worker_id: str) -> None:
        """A migration: stream ``rid`` from ``worker_id`` from now on (it joins ``workers``); the
        request keeps depending on the previous stream worker until the new one sends a token."""
        e = self._entries.get(rid)
        if e is None:
            return
        if worker_id not in e.workers:
            e.workers = (*e.workers, worker_id)
        if e.stream_from != worker_id:
            e.depends_on = (e.stream_from,) if worker_id not in e.depends_on else e.depends_on
            e.stream_from = worker_id

    def move(self, rid: str, target: str) -> bool:
        """Queue a ``Moved`` marker for ``rid`` (its session re-sends it to ``target``) if it is in
        flight and nothing streamed yet; whether it was queued."""
        e = self._entries.get(rid)
        if e is None or e.streamed:
            return False
        e.queue.put_nowait(Moved(target))
        return True

    def local(self, worker_id: str, rid: str) -> bool:
        """Decode worker ``worker_id`` prefills ``rid`` itself (``PrefilledLocally``): its prefill
        worker computes nothing of it, so from now on only ``worker_id``'s death fails it (as after a
        first token), its uncached tokens no longer count as that prefill worker's pending work, and
        that prefill worker's cache does not hold its prompt (``prefilled_locally``). Ignored unless
        ``worker_id`` streams ``rid``; whether it applied."""
        e = self._entries.get(rid)
        if e is None or e.stream_from != worker_id:
            return False
        e.depends_on = (worker_id,)  # ``workers`` keeps the prefill worker: it still gets the aborts
        e.prefill = None
        e.prefilled_locally = True
        return True

    def leave(self, rid: str, worker_id: str) -> None:
        """``worker_id`` holds no state for ``rid`` any more (a migration moved it, or was undone)."""
        e = self._entries.get(rid)
        if e is None:
            return
        e.workers = tuple(w for w in e.workers if w != worker_id)
        e.depends_on = tuple(w for w in e.depends_on if w != worker_id) or (e.stream_from,)

    def workers_of(self, rid: str) -> tuple[str, ...]:
        """The workers holding state for ``rid`` (empty if not in flight)."""
        e = self._entries.get(rid)
        return e.workers if e else ()

    def outstanding(self, worker_id: str) -> int:
        """Sum of ``cost`` of the requests in flight on ``worker_id`` (least-loaded routing)."""
        return sum(e.cost for e in self._entries.values() if worker_id in e.workers)

    def continuations(self, worker_id: str) -> int:
        """How many continuations in flight depend on ``worker_id`` (``depends_on``: their decode
        worker, and their prefill worker until their first new token)."""
        return sum(1 for e in self._entries.values() if e.continuation and worker_id in e.depends_on)

    def outstanding_requests(self, worker_id: str) -> int:
        """How many requests in flight involve ``worker_id``."""
        return sum(1 for e in self._entries.values() if worker_id in e.workers)

    def pending_prefill_tokens(self, worker_id: str) -> int:
        """Uncached prompt tokens of the requests expected to be prefilled on ``worker_id`` whose
        first token has not come yet (``Inflight.prefill``)."""
        return sum(e.prefill[1] for e in self._entries.values() if e.prefill is not None and e.prefill[0] == worker_id)

    def oldest_first_token_wait(self, now: float) -> float:
        """Seconds the longest-waiting request in flight has waited for its first token since it was
        forwarded (``now`` on ``time.monotonic``'s clock); 0 when every one has its first token."""
        return max((now - e.created for e in self._entries.values() if not e.streamed), default=0.0)

    def rids(self) -> list[str]:
        """Ids of every request in flight."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries
