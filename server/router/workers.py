"""The router's view of workers: specs, handles and their states, routes, and routing policies.

States: ``starting`` (never heard from, or refused: ``reason`` says why), ``ready`` (routed to),
``draining`` (it finishes what it holds; nothing new is routed to it), ``switching`` (changing
role: the same, until it answers), ``drained`` (it left after a
drain; not restarted), ``dead`` (silent or exited; its requests failed with 503), ``restarting``
(the launcher started a new process). Policies pick a ``Route`` among the ready handles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transfer.wire.enums import Role
from transfer.wire.protocol import WorkerStats

STARTING, READY, DEAD, RESTARTING = "starting", "ready", "dead", "restarting"
DRAINING, DRAINED = "draining", "drained"
SWITCHING = "switching"  # changing role (``server.router.roles``): out of rotation until it answers
# states a worker is in on purpose: out of rotation, but no reason for /health to fail
OUT_OF_ROTATION = (DRAINING, DRAINED, SWITCHING)


@dataclass(frozen=True)
class WorkerSpec:
    """Where a worker listens and what it does (``role``: colocated, prefill or decode)."""

    worker_id: str
    role: Role
    addr: str


@dataclass
class WorkerHandle:
    """A worker as the router sees it: state, latest stats, last sign of life (monotonic s), and
    since when the router has heard from the current process instance (``up_since``, ``restarts``)."""

    spec: WorkerSpec
    client: Any
    state: str = STARTING
    reason: str = "waiting for its first heartbeat"
    stats: WorkerStats | None = None
    last_seen: float | None = None
    stats_at: float | None = None
    permanent: bool = False
    instance: str = ""  # the worker process's instance id (from its stats); a new one means a restart
    up_since: float | None = None  # when the router first heard from ``instance`` (monotonic s)
    restarts: int = 0  # how many times ``instance`` changed
    leaving: bool = False  # discovery lost it: dropped once it holds no request
    drain_asked: bool = False  # the router asked this process (``instance``) to drain
    own_at_stats: int = 0  # this router's requests in flight on it when its last ``WorkerStats`` arrived
    sources_sent: tuple | None = None  # (instance, KVSources) it was last sent (``server.router.kv_sources``)

    @property
    def worker_id(self) -> str:
        """The worker's id (from its spec)."""
        return self.spec.worker_id

    @property
    def reported_id(self) -> str:
        """The id the worker gives itself (its stats), which its peers know it by; the spec's id
        until it reported (DNS discovery names a worker by its address, ``decode@10.0.0.5``)."""
        return self.stats.worker_id if self.stats is not None else self.spec.worker_id


@dataclass(frozen=True)
class Route:
    """Workers that receive one request (``targets``) and the one whose tokens are streamed."""

    targets: tuple[WorkerHandle, ...]
    stream_from: WorkerHandle
    # (worker id, prompt tokens its cache does not hold): where the policy expects the prompt to be
    # computed (a prefill worker, a colocated replica, or a decode worker that prefills it itself);
    # None: the policy did not look (least-loaded). Feeds ``InflightTable.pending_prefill_tokens``.
    prefill: tuple[str, int] | None = None

    @property
    def capacity_tokens(self) -> int:
        """KV pool capacity (tokens) of the worker that holds the whole sequence: the one streaming
        (PD: the decode worker; the prefill worker holds the prompt alone, ``check_route_fits``)."""
        return self.stream_from.stats.capacity_tokens

    @property
    def max_model_len(self) -> int:
        """Smallest context limit among the targets (tokens)."""
        return min(h.stats.max_model_len for h in self.targets)


def _room(h: WorkerHandle) -> int:
    """The most tokens ``h`` can ever hold for one request: its KV pool or its context, the smaller."""
    return min(h.stats.capacity_tokens, h.stats.max_model_len)


def holds(h: WorkerHandle, prompt_len: int, max_new_tokens: int) -> bool:
    """Whether ``h`` can ever hold its part of a request: a prefill worker the prompt, any other
    worker the prompt plus ``max_new_tokens``."""
    return prompt_len + (0 if h.spec.role == Role.PREFILL else max_new_tokens) <= _room(h)


def by_room(ready: list[WorkerHandle], prompt_len: int, max_new_tokens: int) -> list[list[WorkerHandle]]:
    """Where pools differ, the subsets of ``ready`` to route among first, in order: the workers that
    hold the request (``holds``), then the prefill workers with the workers of the largest pool (so
    a request no route holds is refused naming that pool). Empty where every worker holds it."""
    fit = [h for h in ready if holds(h, prompt_len, max_new_tokens)]
    if len(fit) == len(ready):
        return []
    widest = max((_room(h) for h in ready if h.spec.role != Role.PREFILL), default=0)
    subsets = (fit, [h for h in ready if h.spec.role == Role.PREFILL or _room(h) == widest])
    return [s for s in subsets if s and len(s) < len(ready)]


class NoWorkerAvailable(RuntimeError):
    """No ready worker can take the request (the message says why)."""


Load = Callable[[str], Any]  # a sort key: smaller is less loaded
# (ready handles, load, the request's prompt token ids) -> route; the least-loaded policies ignore the prompt,
# ``server.router.cache_routing.CacheAwarePolicy`` scores it against the workers' radix caches
Policy = Callable[[list[WorkerHandle], Load, Sequence[int]], Route]


def least_outstanding(handles: list[WorkerHandle], load: Load) -> WorkerHandle:
    """The handle with the least outstanding work (ties: lowest worker id)."""
    return min(handles, key=lambda h: (load(h.worker_id), h.worker_id))


def route_colocated(ready: list[WorkerHandle], load: Load, prompt_ids: Sequence[int] = ()) -> Route:
    """Colocated mode: the least loaded ready colocated worker does everything."""
    workers = [h for h in ready if h.spec.role == Role.COLOCATED]
    if not workers:
        raise NoWorkerAvailable("no ready colocated worker")
    w = least_outstanding(workers, load)
    return Route((w,), w)


def route_pd(ready: list[WorkerHandle], load: Load, prompt_ids: Sequence[int] = ()) -> Route:
    """PD mode: the least loaded ready prefill and decode workers; tokens stream from decode."""
    prefill = [h for h in ready if h.spec.role == Role.PREFILL]
    decode = [h for h in ready if h.spec.role == Role.DECODE]
    if not prefill or not decode:
        missing = Role.PREFILL if not prefill else Role.DECODE
        raise NoWorkerAvailable(f"no ready {missing} worker")
    d = least_outstanding(decode, load)
    return Route((least_outstanding(prefill, load), d), d)


def pinned_pd(decode_id: str) -> Policy:
    """PD routing with every request's decode worker pinned to ``decode_id`` while it is ready (else
    ``route_pd``'s choice): the skewed load of ``--route-decode``."""

    def route(ready: list[WorkerHandle], load: Load, prompt_ids: Sequence[int] = ()) -> Route:
        chosen = route_pd(ready, load, prompt_ids)
        d = next((h for h in ready if h.worker_id == decode_id and h.spec.role == Role.DECODE), chosen.stream_from)
        return Route((chosen.targets[0], d), d)

    return route


ROUTING_POLICIES: dict[str, Policy] = {"colocated": route_colocated, "pd": route_pd}


def one_token_route(route: Route, max_new_tokens: int, resume: Sequence[int] = ()) -> Route:
    """``route`` without its decode worker for a new PD request that generates one token
    (``max_new_tokens`` 1): its prefill worker samples that token anyway and answers it itself
    (``prefill_worker.one_token``), so no decode pages, KV write or hand-off are spent on it. Any
    other route (colocated, longer, a continuation) is returned as it is."""
    prefill = next((h for h in route.targets if h.spec.role == Role.PREFILL), None)
    if prefill is None or route.stream_from is prefill or max_new_tokens != 1 or resume:
        return route
    at = route.prefill if route.prefill is not None and route.prefill[0] == prefill.worker_id else None
    return Route((prefill,), prefill, at)


def send_request(
    route: Route, rid: str, room: int, prompt_ids: list[int], params, preempt: bool = False, resume: list[int] = ()
) -> None:
    """Send one request to every worker of ``route`` in the message its role takes.

    Colocated: ``GenerateRequest``. PD: the prefill worker gets a ``PrefillRequest`` naming the
    decode worker by the id it reports (the one its KV handshake carries); the decode worker gets a
    ``GenerateRequest`` with ``room``, the prefill worker's control address (it asks that worker
    for the KV) and ``preempt`` (``Grant.preempt``). Raises ``WorkerUnavailable``.

    ``resume``: a continuation's output so far (``GenerateRequest.resume_output_ids``). In PD the
    prefill worker then gets nothing from here: the decode worker asks it for prompt + output as a
    recompute. A route of a prefill worker alone (``one_token_route``): its ``PrefillRequest`` asks
    it to answer the router itself (``answer_router``).
    """
    prefill = next((h for h in route.targets if h.spec.role == Role.PREFILL), None)
    extra = {"resume_output_ids": list(resume)} if resume else {}
    for h in route.targets:
        if h.spec.role == Role.PREFILL and route.stream_from is h:  # ``one_token_route``
            h.client.prefill(rid, room, prompt_ids, params, "", answer_router=True)
        elif h.spec.role == Role.PREFILL:
            if not resume:
                h.client.prefill(rid, room, prompt_ids, params, route.stream_from.reported_id)
        elif h.spec.role == Role.DECODE:
            h.client.generate(
                rid, prompt_ids, params, room=room, prefill_addr=prefill.spec.addr, preempt=preempt, **extra
            )
        else:
            h.client.generate(rid, prompt_ids, params, **extra)
