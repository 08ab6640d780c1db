"""One prompt's life in the router: route, check limits, send, receive deltas, abort, time.

Lifecycle (every path ends in :meth:`GenerationSession.close`, which is synchronous so it can run
in ``finally`` blocks of cancelled tasks):

1. ``prepare()``: pick a route (503 if no worker is ready) and check prompt + max_tokens against
   the route's context and KV pool capacity from the latest ``WorkerStats`` (400 with the numbers).
2. ``send()``: register in the in-flight table and send to the route's targets the message each
   role takes (``send_request``); a one-token PD request goes to its prefill worker alone, which
   answers it (``one_token_route``). A session sent later than prepared (a follower of ``n`` > 1)
   is routed again if a worker of its route left rotation or changed role meanwhile.
3. ``next()``: the next ``TokenDelta``; a worker error (400 refused, 500 out of KV, 503 worker dead)
   or the request timeout raises ``APIError`` (the request is then already aborted and closed).
   A 503 (a worker of the route died) before any token arrived is retried instead, up to
   ``retries`` times, on another route when the registry has one (``Registry.reroute``): the old
   route's workers get an abort, the request goes out again under a new request id. A ``Moved``
   marker (its decode worker offered it while it waited for pages, ``--migrate-queued``, and the
   router found a peer with room) sends it again the same way to its prefill worker and that peer,
   without aborts (the old decode worker dropped it and withdrew its prefill) and without using a
   retry. A 503 marked ``handed_back`` (its decode worker is changing role and gave it back before
   its first token, ``decode_worker.evacuate``) is no failed attempt either: the request goes out
   again on a new route (``Registry.route``: the switching worker is out of rotation; cache-aware
   routing finds the prefill worker that computed the prompt) without using a retry, at most
   ``HANDBACK_LIMIT`` times (past it, a hand-back is a retry as above), so no request goes round
   switching workers for ever.
   A 503 after tokens were streamed is a failover (``server.router.failover``), up to
   ``failover.limit`` times: the request goes out again, on a live route (waited for until the
   request's deadline), as a continuation carrying the tokens streamed so far; the client's stream
   goes on from the next token. Past the limit, with no live route in time, or when the route does
   not fit, the request ends with a 503 that names the reason.
4. ``close()``: idempotent; removes the in-flight entry and, if the worker has not finished the
   request, sends ``AbortRequest`` so its KV is freed (client gone, stop string, error, timeout).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from cache.fit import FitCheck, RequestRejected
from server.router.errors import APIError
from server.router.failover import (
    CONTINUED,
    LIMIT,
    NO_ROUTE,
    UNFIT,
    UNREACHABLE,
    FailoverBudget,
    live_route,
    prefill_worker,
)
from server.router.inflight import Inflight, InflightTable, Moved
from server.router.registry import READY, NoWorkerAvailable, Registry, Route, send_request
from server.router.worker_client import WorkerUnavailable
from server.router.workers import one_token_route
from transfer.wire.enums import Role
from transfer.wire.protocol import TokenDelta
from transfer.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

#: Hand-backs a request is sent again after without using a retry (module docstring, step 3): one per
#: switching decode worker it meets; a fourth in a row (every switch of a planner that keeps
#: moving workers) is counted as a retry.
HANDBACK_LIMIT = 3


def check_route_fits(prompt_len: int, max_new_tokens: int, route: Route) -> None:
    """``FitCheck.request`` against ``route``'s context and KV pool; a refusal is a 400 ``APIError``
    with the same message and its ``param``/``code``."""
    try:
        FitCheck(route.capacity_tokens, route.max_model_len, restart="server").request(prompt_len, max_new_tokens)
        for h in route.targets:
            if h is not route.stream_from:
                FitCheck(h.stats.capacity_tokens, h.stats.max_model_len, restart="server").prompt(prompt_len)
    except RequestRejected as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


class GenerationSession:
    """Generation of one prompt through the registry's workers (see the module docstring).

    ``params.max_new_tokens`` is used as given unless ``auto_max_tokens``: then it becomes
    whatever room the route leaves (``min(context, pool) - prompt``).
    """

    def __init__(
        self,
        registry: Registry,
        table: InflightTable,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        timeout_s: float,
        auto_max_tokens: bool = False,
        arrival: float | None = None,
        retries: int = 0,
        on_retry: Callable[[], None] | None = None,
        on_move: Callable[[], None] | None = None,
        failover: FailoverBudget | None = None,
        on_hand_back: Callable[[], None] | None = None,
    ) -> None:
        """``retries``: how many times a request whose worker died before its first token is sent
        again on another route; ``on_retry`` is called once per retry, ``on_move`` once per queued
        move and ``on_hand_back`` once per hand-back sent again (the metrics counters). ``failover``:
        the failovers allowed after a token (none when None)."""
        self.registry, self.table = registry, table
        self.rid = f"req-{uuid.uuid4().hex}"
        self.retries_left, self.on_retry, self.on_move = retries, on_retry, on_move
        self.on_hand_back, self.handbacks = on_hand_back, 0
        self.attempt = 0
        self.failover = failover or FailoverBudget()
        self.sent: list[int] = []  # output token ids streamed so far: a continuation's resume_output_ids
        self.failover_error: str | None = None  # why the last failover did not happen
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.auto_max_tokens = auto_max_tokens
        self.timeout_s = timeout_s
        self.arrival = time.monotonic() if arrival is None else arrival
        self.route: Route | None = None
        self._specs: tuple = ()  # the route's workers' specs at ``prepare`` (``route_current``)
        self.preempt = False  # the admission grant's mark (``Grant.preempt``), sent to the decode worker
        self.inflight: Inflight | None = None
        self.finished = self.closed = False
        self.n_tokens = 0
        self.t_sent: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def prepare(self, route: Route | None = None) -> None:
        """Pick the route (``route`` when given: another choice of the same prompt shares it) and
        check limits; raises ``APIError`` (503 / 400). Nothing is sent."""
        try:
            self.route = route or self.registry.route(
                self.prompt_ids, 0 if self.auto_max_tokens else self.params.max_new_tokens
            )
        except NoWorkerAvailable as e:
            raise APIError(503, f"no worker available: {e}", code="worker_unavailable") from None
        if self.auto_max_tokens:
            room = min(self.route.max_model_len, self.route.capacity_tokens) - len(self.prompt_ids)
            self.params = self.params.model_copy(update={"max_new_tokens": max(room, 1)})
        check_route_fits(len(self.prompt_ids), self.params.max_new_tokens, self.route)
        self._specs = tuple(h.spec for h in self.route.targets)

    def route_current(self) -> bool:
        """Whether every worker of the prepared route is still the registry's, ready, in the role
        (the same ``WorkerSpec``) it had at ``prepare``: a session sent later than prepared (a
        follower waits for its leader's first token) must not go to a worker that left rotation or
        switched role meanwhile."""
        assert self.route is not None, "prepare() first"
        return all(
            self.registry.handles.get(h.worker_id) is h and h.state == READY and h.spec is spec
            for h, spec in zip(self.route.targets, self._specs)
        )

    def send(self) -> None:
        """Register in the in-flight table and send the request; raises ``APIError`` 503 on failure."""
        assert self.route is not None, "prepare() first"
        self.t_sent = time.monotonic()
        try:
            self._dispatch()
        except WorkerUnavailable as e:
            self.close("could not reach every worker of the route")
            raise APIError(503, str(e), code="worker_unavailable") from None

    def _dispatch(self) -> None:
        """Open the in-flight entry for ``rid`` and send to ``route`` (a one-token PD request to its
        prefill worker alone, ``one_token_route``); raises ``WorkerUnavailable``."""
        self.route = one_token_route(self.route, self.params.max_new_tokens, self.sent)
        cost = len(self.prompt_ids) + self.params.max_new_tokens
        self.inflight = self.table.open(
            self.rid,
            tuple(h.worker_id for h in self.route.targets),
            self.route.stream_from.worker_id,
            cost,
            prefill=self.route.prefill,
            continuation=bool(self.sent),
        )
        params = self.params
        if self.sent:  # a continuation: the prompt's logprobs went out with the first token already
            params = params.model_copy(update={"prompt_logprobs": None})
        send_request(
            self.route, self.rid, self.registry.next_room(), self.prompt_ids, params, self.preempt, resume=self.sent
        )

    async def next(self) -> TokenDelta:
        """The next delta. Raises ``APIError`` on a worker error or timeout (already closed then)."""
        assert self.inflight is not None and not self.finished, "send() first; nothing after the last delta"
        while True:
            remaining = self.arrival + self.timeout_s - time.monotonic()
            try:
                delta = await asyncio.wait_for(self.inflight.queue.get(), max(remaining, 0.0))
            except TimeoutError:
                self.close(f"request timed out after {self.timeout_s:g}s")
                raise APIError(
                    504,
                    f"request timed out after {self.timeout_s:g}s (request_timeout_s); it was aborted",
                    code="timeout",
                ) from None
            if isinstance(delta, Moved):
                self._move(delta.target)
                continue
            if delta.finish_reason != "abort" or not await self._again(delta):
                break
        if delta.finish_reason == "abort":  # the other workers of the route may still hold its state
            self.close(f"failed on another worker: {delta.error}")
            self.finished = True
            raise APIError(delta.error_status or 500, self.failover_error or delta.error or "the worker aborted")
        if self.failover.used:  # a continuation's prefix hits are not the prompt's: counted once
            delta.cached_tokens = 0
        self.sent += delta.token_ids
        self._clock_tokens(len(delta.token_ids))
        if delta.finish_reason:
            self.finished = True
            self.close()
        return delta

    def close(self, reason: str = "aborted by the router") -> None:
        """Leave the in-flight table; abort in the worker(s) if they have not finished it."""
        if self.closed:
            return
        self.closed = True
        self._leave(reason)
        if log.isEnabledFor(logging.DEBUG):  # one line per request: benchmarks.handoff_trace lines up the hops
            stamps = {
                "arrived": self.arrival,
                "sent": self.t_sent,
                "first_token": self.t_first,
                "last_token": self.t_last,
            }
            log.debug(
                "request %s marks (monotonic s): %s",
                self.rid,
                " ".join(f"{k}={v:.6f}" for k, v in stamps.items() if v is not None),
            )

    def _leave(self, reason: str) -> None:
        """Remove ``rid`` from the in-flight table and abort it on the route's workers if unfinished."""
        self.table.close(self.rid)
        if self.inflight is not None and not self.finished and self.route is not None:
            # the entry's workers, not the route's: a migration may have moved the request
            handles = {h.worker_id: h for h in self.route.targets}
            for wid in self.inflight.workers:
                h = handles.get(wid) or self.registry.handles.get(wid)
                if h is not None:
                    h.client.abort([self.rid], reason)

    async def _again(self, failed: TokenDelta) -> bool:
        """Whether the request went out again after the abort ``failed``: as a hand-back, else a
        retry, else a failover (module docstring, step 3)."""
        handed = self._hand_back(failed)
        if handed is not None:
            return handed
        return self._retry(failed) or await self._failover(failed)

    def _hand_back(self, failed: TokenDelta) -> bool | None:
        """Send the request again on a new route if its decode worker handed it back (changing role)
        before any token, within ``HANDBACK_LIMIT``, using no retry: True when it went out again,
        False when a worker of the new route could not be reached, None when it is no hand-back to
        send so (not one, past the limit, or no route now: the retry path takes it)."""
        if not failed.handed_back or self.n_tokens or self.handbacks >= HANDBACK_LIMIT:
            return None
        try:
            route = self.registry.route(self.prompt_ids, 0 if self.auto_max_tokens else self.params.max_new_tokens)
            check_route_fits(len(self.prompt_ids), self.params.max_new_tokens, route)
        except (NoWorkerAvailable, APIError):
            return None
        self.handbacks += 1
        if not self._resend(route, f"handed back: {failed.error}"):
            return False
        if self.on_hand_back is not None:
            self.on_hand_back()
        return True

    def _resend(self, route: Route, reason: str) -> bool:
        """Abort the request on its workers and send it to ``route`` under the next request id;
        False if a worker of ``route`` could not be reached (the caller fails the request)."""
        self._leave(reason)
        self.attempt += 1
        self.route, self.rid = route, f"{self.rid.split('~')[0]}~{self.attempt}"
        try:
            self._dispatch()
        except WorkerUnavailable:
            return False
        return True

    def _retry(self, failed: TokenDelta) -> bool:
        """Send the request again on another route if a worker of this one died (503) before any
        token arrived and a retry is left; True when it went out again (see the module docstring)."""
        if failed.error_status != 503 or self.n_tokens or self.retries_left <= 0:
            return False
        route = self.registry.reroute(self.route, self.prompt_ids)
        if route is None:
            return False
        try:
            check_route_fits(len(self.prompt_ids), self.params.max_new_tokens, route)
        except APIError:
            return False
        self.retries_left -= 1
        if not self._resend(route, f"retried on another route: {failed.error}"):
            return False  # the caller fails the request with the original error (and closes this entry)
        if self.on_retry is not None:
            self.on_retry()
        return True

    async def _failover(self, failed: TokenDelta) -> bool:
        """Send the request again as a continuation on a live route if a worker of this one died
        (503) after tokens were streamed and a failover is left; True when it went out again. Else
        ``failover_error`` says why not (the caller ends the request with it)."""
        if failed.error_status != 503 or not self.sent or self.failover.limit <= 0:
            return False
        worker = self.inflight.stream_from if self.inflight is not None else ""
        at_prefill = self.inflight is None or not self.inflight.prefilled_locally
        why, outcome = f"{failed.error}; not continued after {len(self.sent)} tokens: ", None
        route, old = None, prefill_worker(self.route) if at_prefill else None
        if self.failover.left <= 0:
            outcome, why = LIMIT, why + f"--max-failovers {self.failover.limit} reached"
        else:
            deadline = self.arrival + self.timeout_s
            route = await live_route(
                self.registry, self.route, self.prompt_ids, deadline, sent=len(self.sent), prompt_at_prefill=at_prefill
            )
            if route is None:
                outcome, why = NO_ROUTE, why + "no live route (another worker) before the request's deadline"
        if route is not None:
            try:
                check_route_fits(len(self.prompt_ids), self.params.max_new_tokens, route)
            except APIError as e:
                outcome, why = UNFIT, why + f"no live route holds it ({e.message})"
        if outcome is None:
            self._leave(f"continued on another route: {failed.error}")
            self.attempt += 1
            self.route, self.rid = route, f"{self.rid.split('~')[0]}~{self.attempt}"
            try:
                self._dispatch()
                outcome = CONTINUED
            except WorkerUnavailable as e:
                outcome, why = UNREACHABLE, why + f"the live route could not be reached ({e})"
        if outcome == CONTINUED and self.failover.stalled_since is None:
            self.failover.stalled_since = self.t_last
        same = old is not None and route is not None and prefill_worker(route) is old
        self.failover.record(worker, outcome, len(self.sent), same_prefill=same)
        self.failover_error = None if outcome == CONTINUED else why
        if outcome != CONTINUED:
            log.warning("request %s: %s", self.rid, why)
        return outcome == CONTINUED

    def _move(self, target_id: str) -> None:
        """Send the request again to its prefill worker and decode worker ``target_id`` (a queued
        move: the old decode worker dropped it, nothing streamed); ``APIError`` 503 (closed) if
        that cannot be done."""
        target = self.registry.handles.get(target_id)
        prefill = [h for h in self.route.targets if h.spec.role == Role.PREFILL]
        self.table.close(self.rid)  # no aborts: the old decode worker dropped it and withdrew its prefill
        if target is None or not prefill:
            self.inflight = None
            self.close("moved to a decode worker that left")
            raise APIError(503, f"request moved to decode worker {target_id}, which is gone", code="worker_unavailable")
        self.route = Route((*prefill, target), target, self.route.prefill)
        self.attempt += 1
        self.rid = f"{self.rid.split('~')[0]}~{self.attempt}"
        try:
            self._dispatch()
        except WorkerUnavailable as e:
            self.close("could not reach every worker of the new route")
            raise APIError(
                503, f"request moved to {target_id} but could not be sent: {e}", code="worker_unavailable"
            ) from None
        if self.on_move is not None:
            self.on_move()

    # ---- timing ----------------------------------------------------------------------------------
    def _clock_tokens(self, n: int) -> None:
        if n == 0:
            return
        now = time.monotonic()
        self.failover.resumed(now)
        self.t_first = self.t_first if self.t_first is not None else now
        self.t_last, self.n_tokens = now, self.n_tokens + n

    def latency(self) -> tuple[float | None, float | None, float, float | None]:
        """(time to first token, time per output token after the first, end-to-end, router queue:
        arrival to the request going out to the workers) in seconds."""
        end = self.t_last if self.t_last is not None else time.monotonic()
        ttft = None if self.t_first is None else self.t_first - self.arrival
        tpot = None
        if self.n_tokens > 1 and self.t_first is not None:
            tpot = (end - self.t_first) / (self.n_tokens - 1)
        queue = None if self.t_sent is None else self.t_sent - self.arrival
        return ttft, tpot, end - self.arrival, queue
