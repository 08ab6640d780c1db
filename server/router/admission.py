"""The router's admission stage: a bounded queue in front of the workers, with load shedding.

Contract of :class:`Admission` (all methods run on the event loop thread):

- ``admit(demand)`` returns a :class:`Grant` once the request may go to the workers, or raises
  :class:`Refused`. A request is granted at once while the router's forwarding slots
  (``capacity()``: e.g. a bound per ready decode worker) have room and nobody waits; otherwise it
  waits in the router's own queue. No worker is touched before the grant.
- Refusals: **429** at once when queueing it would put the queue over ``max_queued_requests`` or
  ``max_queued_tokens`` and nothing queued is shed before it (``queue_full`` / ``queue_tokens``),
  or when its estimated wait (queued work that would be served before it / measured drain rate)
  exceeds ``max_queue_wait_s`` (``queue_wait``). A queued request can also be pushed out by a
  newcomer that ranks before it in the shedding order (``displaced``, 429). Every 429 carries
  ``retry_after_s``, computed from the drain rate (1 s until a rate is measured). **504** when a
  request is still queued at its ``deadline`` (``deadline``). A cancelled ``admit`` (client gone)
  leaves the queue and holds nothing.
- ``refuse_early(key, priority, min_tokens)`` raises the same 429 ``admit`` would, before the
  request is validated or tokenized, when that outcome is already certain; otherwise it does
  nothing and ``admit`` decides.
- ``release(grant)`` must be called once per grant when the request has ended (idempotent): it
  frees the grant's slots, feeds the drain rate (unless the request failed without running) and
  lets the next queued requests go.
- ``pump()`` lets queued requests go while there is room; call it when ``capacity()`` may have
  grown (a worker became ready). ``release`` and ``admit`` call it themselves.

Ordering: fair across keys first (API keys; one key ``default`` without them), then by priority.
The next request to go is taken from the key with the fewest granted slots per unit of ``share``
(ties: the best head of line); within a key, the lowest ``priority`` value goes first (vLLM's
convention), then arrival order. So a key sending ten times more than another with the same share
gets the same number of slots under contention and cannot starve it.

Headroom for keys under their share (:class:`~server.router.fair_headroom.FairHeadroom`): while two
or more keys are active, a key already holding its share of the slots may not take the last few, so
a key under its share starts at once instead of waiting for a heavy key's request to finish; with
one active key every slot is used (work-conserving). With ``FairHeadroom.preempt`` (PD), a grant
that leaves its key below another active key (``FairHeadroom.under_share``) is made even when every
slot is taken and is marked ``Grant.preempt`` (a PD decode worker with a full batch retracts a
request without the mark to start it).

Shedding order (who is refused first when the queue is full): the key with the most queued
requests per unit of share, within it the highest ``priority`` value, then the newest arrival.
With a single key that is simply lowest priority first, newest first.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from server.router.drain_rate import DrainRate
from server.router.fair_headroom import FairHeadroom

DEFAULT_KEY = "default"
UNKNOWN_RATE_RETRY_S = 1.0
MAX_RETRY_S = 300.0


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds of the router's queue (see the module docstring); None = no such bound."""

    max_queued_requests: int
    max_queued_tokens: int | None = None
    max_queue_wait_s: float | None = None


@dataclass(frozen=True)
class Demand:
    """What one HTTP request asks for: its ``key`` (tenant), ``priority`` (lower = sooner),
    forwarding ``slots`` (one per choice), ``tokens`` (prompt + max_tokens over its choices) and the
    monotonic ``deadline`` past which it is refused with 504 if still queued."""

    key: str
    priority: int
    slots: int
    tokens: int
    deadline: float


class Refused(Exception):
    """The request is not forwarded: HTTP ``status`` (429 or 504), a ``reason`` (metrics label:
    queue_full, queue_tokens, queue_wait, displaced, deadline) and, for 429, ``retry_after_s``."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after_s = status, reason, message, retry_after_s


@dataclass
class Grant:
    """A granted request: what it asked for, how long it waited in the queue (seconds) and whether
    it left its key below another active key (``preempt``: it may displace a running request
    without the mark)."""

    demand: Demand
    waited_s: float
    released: bool = False
    preempt: bool = False


@dataclass
class _Waiter:
    demand: Demand
    seq: int
    arrival: float
    future: asyncio.Future = field(repr=False)


class Admission:
    """Bounded, fair, priority-ordered admission in front of the workers (module docstring)."""

    def __init__(
        self,
        limits: AdmissionLimits,
        capacity: Callable[[], int],
        *,
        shares: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[Refused], None] | None = None,
        on_granted: Callable[[Grant], None] | None = None,
        drain: DrainRate | None = None,
        headroom: FairHeadroom | None = None,
    ) -> None:
        """``capacity()``: forwarding slots now (0 when no worker is ready: requests are then
        granted at once so routing answers 503 with the reason). ``shares``: key -> share (keys
        not named get 1). ``on_refused`` / ``on_granted``: metrics hooks, called once per outcome.
        ``headroom``: the slots a key at its share leaves free for others (module docstring; None =
        none)."""
        self.limits, self.capacity, self.clock = limits, capacity, clock
        self.headroom = headroom or FairHeadroom(lambda: 0)
        self.shares: defaultdict[str, float] = defaultdict(lambda: 1.0, shares or {})
        self.on_refused, self.on_granted = on_refused, on_granted
        self.drain = drain or DrainRate()
        self._queues: dict[str, list[_Waiter]] = {}
        self._granted: dict[str, int] = {}
        self._inflight = 0
        self._seq = itertools.count()

    # ---- public --------------------------------------------------------------------------------
    @property
    def queued_requests(self) -> int:
        """Requests waiting in the queue."""
        return sum(len(q) for q in self._queues.values())

    @property
    def queued_tokens(self) -> int:
        """Prompt + max_tokens of the requests waiting in the queue."""
        return sum(w.demand.tokens for q in self._queues.values() for w in q)

    @property
    def inflight_slots(self) -> int:
        """Slots granted and not yet released."""
        return self._inflight

    def queued_by_key(self) -> dict[str, tuple[int, int]]:
        """key -> (queued requests, queued tokens), for every key with something queued."""
        return {k: (len(q), sum(w.demand.tokens for w in q)) for k, q in self._queues.items() if q}

    def try_grant(self, demand: Demand) -> Grant | None:
        """A grant at once when nobody waits and there is room, else None (only the key's last
        arrival is noted)."""
        now = self.clock()
        self.headroom.arrived(demand.key, now)
        if self.queued_requests or not self._room(demand):
            return None
        return self._grant(demand, now, now)

    async def admit(self, demand: Demand) -> Grant:
        """Wait for a grant or raise ``Refused`` (see the module docstring); cancellation-safe."""
        if (grant := self.try_grant(demand)) is not None:
            return grant
        now = self.clock()
        if now >= demand.deadline:
            raise self._refuse(Refused(504, "deadline", "request timed out before it could be queued"))
        waiter = _Waiter(demand, next(self._seq), now, asyncio.get_running_loop().create_future())
        self._check_wait(demand, now)
        self._make_room(waiter)
        self._queues.setdefault(demand.key, []).append(waiter)
        self.pump()
        return await self._wait(waiter)

    def release(self, grant: Grant, drained: bool = True) -> None:
        """The granted request ended: free its slots, record its work in the drain rate unless
        ``drained`` is False (it failed without running: a 400/503), let queued requests go."""
        if grant.released:
            return
        grant.released = True
        d = grant.demand
        self._inflight -= d.slots
        self._granted[d.key] = self._granted.get(d.key, 0) - d.slots
        if drained:
            self.drain.record(self.clock(), d.tokens)
        self.pump()

    def pump(self) -> None:
        """Grant queued requests in order while the forwarding slots have room: the first head in
        ``_heads`` order that has room goes (a key held back by its share does not hold back a key
        under its share, which may have room past the slots)."""
        while (waiter := next((w for w in self._heads() if self._room(w.demand)), None)) is not None:
            self._remove(waiter)
            waiter.future.set_result(self._grant(waiter.demand, waiter.arrival, self.clock()))

    def refuse_early(self, key: str, priority: int, min_tokens: int = 1) -> None:
        """Raise now the 429 ``Refused`` that ``admit`` would raise for any request of ``key`` at
        ``priority`` with at least ``min_tokens`` tokens (prompt + max_tokens), when that outcome is
        already certain: no room and its estimated wait (counting ``min_tokens``) over
        ``max_queue_wait_s`` (``queue_wait``), or the queue at ``max_queued_requests`` with this
        request first in the shedding order (``queue_full``). Lets the router answer before it
        validates or tokenizes the body; does nothing when the request might be granted, queued or
        displace someone (the full ``admit`` then decides, the token bound included)."""
        probe = Demand(key, priority, 1, max(1, min_tokens), math.inf)
        if not self.queued_requests and self._room(probe):
            return
        self._check_wait(probe, self.clock())
        if self.queued_requests + 1 <= self.limits.max_queued_requests:
            return
        load = _load([w.demand for q in self._queues.values() for w in q] + [probe])
        mine = _shed_rank(probe, load, self.shares)
        if all(_shed_rank(w.demand, load, self.shares) <= mine for q in self._queues.values() for w in q):
            raise self._refuse(_queue_full(self, probe, "queue_full"))

    def retry_after_s(self, demand: Demand) -> float:
        """Seconds until ``demand`` would likely find room: the work queued before it over the
        drain rate (``UNKNOWN_RATE_RETRY_S`` until a rate is measured), within [0.1, 300]."""
        rate = self.drain.tokens_per_s(self.clock())
        if not rate:
            return UNKNOWN_RATE_RETRY_S
        return min(MAX_RETRY_S, max(0.1, (_work_ahead(self._queues, self.shares, demand) + demand.tokens) / rate))

    # ---- queue mechanics ---------------------------------------------------------------------
    def _room(self, demand: Demand) -> bool:
        cap = self.capacity()
        if cap <= 0 or self._inflight == 0:
            return True
        if self.headroom.preempt and self._inflight + demand.slots <= 2 * cap and _under_share(self, demand, cap):
            return True  # past the slots: a PD decode worker preempts for it (bounded at twice them)
        kept = self.headroom.kept_from(
            demand.key, demand.slots, cap, self._granted, self._queues.keys(), self.shares, self.clock()
        )
        return self._inflight + demand.slots <= cap - kept

    def _grant(self, demand: Demand, arrival: float, now: float) -> Grant:
        cap = self.capacity()
        preempt = self.headroom.preempt and cap > 0 and _under_share(self, demand, cap)
        self._inflight += demand.slots
        self._granted[demand.key] = self._granted.get(demand.key, 0) + demand.slots
        self.drain.start(now)
        self.headroom.granted(demand.key, demand.tokens, now)
        grant = Grant(demand, now - arrival, preempt=preempt)
        if self.on_granted is not None:
            self.on_granted(grant)
        return grant

    def _heads(self) -> list[_Waiter]:
        """Each key's head of line (lowest priority value, then arrival), keys in the order they go:
        least granted slots per share first."""
        heads = [min(q, key=lambda w: (w.demand.priority, w.seq)) for q in self._queues.values() if q]
        return sorted(
            heads,
            key=lambda w: (self._granted.get(w.demand.key, 0) / self.shares[w.demand.key], w.demand.priority, w.seq),
        )

    def _remove(self, waiter: _Waiter) -> None:
        q = self._queues.get(waiter.demand.key, [])
        if waiter in q:
            q.remove(waiter)
        if not q:
            self._queues.pop(waiter.demand.key, None)

    async def _wait(self, waiter: _Waiter) -> Grant:
        timeout = max(0.0, waiter.demand.deadline - self.clock())
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:  # the client went away while queued
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise self._refuse(
                Refused(
                    504,
                    "deadline",
                    f"request timed out after waiting "
                    f"{self.clock() - waiter.arrival:.1f}s in the router's queue "
                    f"(timeout / request_timeout_s); it never reached a worker",
                )
            )
        return waiter.future.result()  # a Refused set by _make_room is raised here

    def _abandon(self, waiter: _Waiter) -> None:
        """Leave the queue; a grant that raced with the cancellation is released at once."""
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            self.release(waiter.future.result())
            return
        self._remove(waiter)
        waiter.future.cancel()

    # ---- shedding ------------------------------------------------------------------------------
    def _refuse(self, refused: Refused) -> Refused:
        if self.on_refused is not None:
            self.on_refused(refused)
        return refused

    def _make_room(self, newcomer: _Waiter) -> None:
        """Refuse ``newcomer`` (raise) or displace the queued requests that shed before it, so the
        queue stays within its bounds with it."""
        everyone = [w for q in self._queues.values() for w in q] + [newcomer]
        n, tokens = len(everyone), sum(w.demand.tokens for w in everyone)
        load = _load([w.demand for w in everyone])
        order = sorted(everyone, key=lambda w: (*_shed_rank(w.demand, load, self.shares), w.seq), reverse=True)
        victims = []
        while (reason := _over(self.limits, n, tokens)) is not None:
            victim = order.pop(0)
            if victim is newcomer:
                raise self._refuse(_queue_full(self, newcomer.demand, reason))
            victims.append(victim)
            n, tokens = n - 1, tokens - victim.demand.tokens
        for v in victims:
            self._remove(v)
            v.future.set_exception(
                self._refuse(
                    Refused(
                        429,
                        "displaced",
                        "server overloaded: this queued request was displaced by one of a higher "
                        "priority or a key under its share; retry later",
                        self.retry_after_s(v.demand),
                    )
                )
            )

    def _check_wait(self, demand: Demand, now: float) -> None:
        limit = self.limits.max_queue_wait_s
        rate = self.drain.tokens_per_s(now)
        if limit is None or not rate:
            return
        wait = _work_ahead(self._queues, self.shares, demand) / rate
        if wait > limit:
            raise self._refuse(
                Refused(
                    429,
                    "queue_wait",
                    f"server overloaded: estimated wait in the router's queue "
                    f"{wait:.1f}s exceeds max_queue_wait_s={limit:g}; retry later",
                    self.retry_after_s(demand),
                )
            )


def _under_share(adm: Admission, demand: Demand, cap: int) -> bool:
    """``FairHeadroom.under_share`` of ``demand`` against ``adm``'s grants, queue and shares now."""
    return adm.headroom.under_share(
        demand.key, demand.slots, cap, adm._granted, adm._queues.keys(), adm.shares, adm.clock()
    )


def default_inflight_per_worker(max_running_requests: int) -> int:
    """The forwarding bound per worker when ``--max-inflight-per-worker`` is not given: the
    worker's batch (``max_running_requests``) plus a margin of an eighth of it (at least 2), so a
    slot that frees in the batch finds the next request already at the worker (the batch stays
    full) while everything beyond waits here, where priorities and key shares order it, instead of
    in the worker's first-come queue."""
    return max_running_requests + max(2, max_running_requests // 8)


def _work_ahead(queues: Mapping[str, list[_Waiter]], shares: Mapping[str, float], demand: Demand) -> float:
    """Queued tokens that would go before ``demand``: its own key's at a better or equal
    priority, and from every other key as much as that key's share allows meanwhile."""
    own = sum(w.demand.tokens for w in queues.get(demand.key, ()) if w.demand.priority <= demand.priority)
    share = shares[demand.key]
    ahead = float(own)
    for key, q in queues.items():
        if key != demand.key and q:
            ahead += min(sum(w.demand.tokens for w in q), (own + demand.tokens) * shares[key] / share)
    return ahead


def _load(demands: list[Demand]) -> dict[str, int]:
    """Queued requests per key (``demands``: the queue with the newcomer)."""
    load: dict[str, int] = {}
    for d in demands:
        load[d.key] = load.get(d.key, 0) + 1
    return load


def _shed_rank(demand: Demand, load: Mapping[str, int], shares: Mapping[str, float]) -> tuple[float, int]:
    """Shedding order, highest first (then newest first): queued per share of its key, priority value."""
    return load[demand.key] / shares[demand.key], demand.priority


def _queue_full(adm: Admission, demand: Demand, reason: str) -> Refused:
    """The 429 for a newcomer that does not fit ``adm``'s queue bound ``reason`` (not yet counted)."""
    limit = (
        f"max_queued_requests={adm.limits.max_queued_requests}"
        if reason == "queue_full"
        else f"max_queued_tokens={adm.limits.max_queued_tokens}"
    )
    return Refused(
        429,
        reason,
        f"server overloaded: the router's queue is full ({limit}, {adm.queued_requests} "
        f"requests / {adm.queued_tokens} tokens queued); retry later or lower the request's priority value",
        adm.retry_after_s(demand),
    )


def _over(limits: AdmissionLimits, n: int, tokens: int) -> str | None:
    """Which bound a queue of ``n`` requests / ``tokens`` tokens exceeds, or None."""
    if n > limits.max_queued_requests:
        return "queue_full"
    if limits.max_queued_tokens is not None and tokens > limits.max_queued_tokens:
        return "queue_tokens"
    return None


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1, RFC 9110) and ``retry-after-ms`` (milliseconds,
    as OpenAI's API and clients use it) for a wait of ``seconds``."""
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, round(seconds * 1000)))}
