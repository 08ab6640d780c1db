"""Failover of a streaming request: when a worker of its route dies after tokens were streamed,
the request goes out again on a live route as a continuation (``GenerateRequest.resume_output_ids``:
the tokens streamed so far), so the client's stream goes on with no gap, no duplicate and no error.

``FailoverBudget`` is one request's allowance (``--max-failovers``) and the counters it moves;
``live_route`` waits for a route of ready workers other than the failed one until a deadline, as
long as a worker outside the failed route may become ready (one starting or restarting); with none
it answers at once. ``continuation_route`` is the route it takes: in PD, when the streaming worker is
the one gone, the continuation keeps the failed route's prefill worker if it is ready (its radix
cache holds the prompt it prefilled, so the recompute computes the sent tokens only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.router.registry import READY, RESTARTING, STARTING, Registry, Route, WorkerHandle
from transfer.wire.enums import Role

CONTINUED = "continued"  # sent again on a live route
LIMIT = "limit"  # --max-failovers reached
NO_ROUTE = "no_route"  # no live route before the request's deadline
UNFIT = "unfit"  # prompt + max_tokens does not fit the only live routes
UNREACHABLE = "unreachable"  # the new route's workers could not be sent to
OUTCOMES = (CONTINUED, LIMIT, NO_ROUTE, UNFIT, UNREACHABLE)


@dataclass
class FailoverBudget:
    """How many failovers one request has left, and the metric hooks: ``on_outcome(worker,
    outcome)`` once per failover attempt (``worker``: the one that was streaming), ``on_recomputed(n)``
    with the tokens a continuation makes the new route compute again (the output so far),
    ``on_same_prefill()`` once per continuation sent to the prefill worker of its failed route (PD:
    the one whose cache holds its prompt), ``on_stall(s)`` with the gap the client saw: its last
    token before the failure to its first token from the new route."""

    limit: int = 0
    used: int = 0
    on_outcome: Callable[[str, str], None] | None = None
    on_recomputed: Callable[[int], None] | None = None
    on_same_prefill: Callable[[], None] | None = None
    on_stall: Callable[[float], None] | None = None
    stalled_since: float | None = None  # monotonic time of the last token before a continuation

    @property
    def left(self) -> int:
        return self.limit - self.used

    def resumed(self, now: float) -> None:
        """A token came: if a continuation was waiting for its first one, report the stall."""
        if self.stalled_since is not None:
            if self.on_stall is not None:
                self.on_stall(now - self.stalled_since)
            self.stalled_since = None

    def record(self, worker: str, outcome: str, recomputed: int = 0, same_prefill: bool = False) -> None:
        """Count one attempt; a ``CONTINUED`` one uses up one failover (``same_prefill``: it went to
        the prefill worker of the failed route)."""
        if outcome == CONTINUED:
            self.used += 1
            if self.on_recomputed is not None:
                self.on_recomputed(recomputed)
            if same_prefill and self.on_same_prefill is not None:
                self.on_same_prefill()
        if self.on_outcome is not None:
            self.on_outcome(worker, outcome)


def prefill_worker(route: Route) -> WorkerHandle | None:
    """The prefill worker of ``route`` (PD), None for a colocated route."""
    return next((h for h in route.targets if h.spec.role == Role.PREFILL), None)


def cache_holder(registry: Registry, failed: Route) -> WorkerHandle | None:
    """The prefill worker of ``failed`` whose cache holds the request's prompt, when a continuation
    should go back to it: the route's prefill worker, still ready under the same handle, while the
    streaming worker is not ready (its death is the failure). None otherwise: no prefill worker
    (colocated), the prefill worker gone, or the streaming worker alive (then the failure may be
    the prefill worker's, which another worker reported before the registry saw it)."""
    prefill = prefill_worker(failed)
    if prefill is None or failed.stream_from.state == READY:
        return None
    return prefill if prefill.state == READY and registry.handles.get(prefill.worker_id) is prefill else None


def continuation_route(
    registry: Registry, failed: Route, prompt_ids: Sequence[int], sent: int = 0, prompt_at_prefill: bool = True
) -> Route | None:
    """``registry.reroute(failed)`` (a fresh pair when there is one), but with the prefill worker
    that prefilled the prompt (``cache_holder``) in place of the policy's pick: a fresh pair would
    send the recompute to a prefill worker whose cache misses the prompt, and the continuation
    would compute it all again. The decode worker stays the policy's pick; when the policy expected
    the replaced prefill worker to compute the prompt (``Route.prefill``), the holder is expected to
    compute the ``sent`` tokens and the prompt's partial last page instead. ``prompt_at_prefill``
    False (the failed decode worker prefilled the request itself, ``PrefilledLocally``): no prefill
    worker holds the prompt, the policy's pick stands."""
    route = registry.reroute(failed, prompt_ids)
    holder = cache_holder(registry, failed) if prompt_at_prefill else None
    if route is None or holder is None:
        return route
    picked = prefill_worker(route)
    if picked is None or picked is holder:
        return route
    prefill = route.prefill
    if prefill is not None and prefill[0] == picked.worker_id:
        page = holder.stats.page_size if holder.stats is not None else 1
        prefill = (holder.worker_id, sent + len(prompt_ids) % max(page, 1))
    targets = tuple(holder if h is picked else h for h in route.targets)
    return Route(targets, route.stream_from, prefill)


async def live_route(
    registry: Registry,
    failed: Route,
    prompt_ids: Sequence[int],
    deadline: float,
    poll_s: float = 0.05,
    sent: int = 0,
    prompt_at_prefill: bool = True,
) -> Route | None:
    """``continuation_route(failed)`` as soon as it has one, polled every ``poll_s`` until the
    monotonic ``deadline``; None if none came in time, or at once when no worker outside ``failed``
    is ready, starting or restarting (nothing can make a route appear). ``sent``: the tokens the
    continuation carries; ``prompt_at_prefill``: as ``continuation_route``'s."""
    old = {h.worker_id for h in failed.targets}
    while True:
        route = continuation_route(registry, failed, prompt_ids, sent, prompt_at_prefill)
        hope = any(
            h.state in (READY, STARTING, RESTARTING) and h.worker_id not in old for h in registry.handles.values()
        )
        if route is not None or not hope or time.monotonic() >= deadline:
            return route
        await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))
