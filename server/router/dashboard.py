"""The live dashboard: ``GET /dashboard`` (a static page) and ``GET /dashboard/data`` (a JSON snapshot).

The snapshot is a thin, stateless view over what ``/metrics`` renders: the router's own series
(requests by status, TTFT/TPOT/E2E histograms, in-flight count) read from ``RouterMetrics`` and each
worker's state from the registry with its latest ``WorkerStats`` (counters, gauges, histograms) as
received. The page polls it every second and keeps the last ten minutes of history itself (rates
and windowed percentiles are computed in the browser from successive snapshots), so the router
runs no sampling task and holds no history for a page nobody has open; Prometheus stays the
long-term store.

Access: the page and its assets carry no data and are always served (a browser navigation cannot
send a bearer token); ``/dashboard/data`` needs ``Authorization: Bearer <api_key>`` when an API key
is configured, like ``/v1/*``. The page asks for the key and keeps it in session storage. Assets
ship inside the package (``server/router/static/``); a content security policy forbids anything
not served by the router itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from prometheus_client import Counter, Histogram
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse

from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import check_api_key
from server.router.registry import READY, WorkerHandle

STATIC_DIR = Path(__file__).with_name("static")
ASSETS = {
    "dashboard.js": "text/javascript",
    "chart.js": "text/javascript",
    "roles.js": "text/javascript",
    "spec.js": "text/javascript",
    "dashboard.css": "text/css",
}
SNAPSHOT_VERSION = 1
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


class HistogramSnapshot(BaseModel):
    """Non-cumulative bucket counts (``counts[i]`` for ``value <= buckets[i]``, last is +Inf), as in
    ``WorkerStats.histograms``."""

    buckets: list[float]
    counts: list[int]
    sum: float


class WorkerSnapshot(BaseModel):
    """One worker: registry state (``state``: ready / dead / restarting / starting / draining /
    drained) and its latest stats.

    ``stats_t`` is the router's monotonic time when those stats arrived (rates divide by its deltas);
    ``uptime_s`` counts from the first heartbeat of the current process instance.
    """

    id: str
    role: str
    state: str
    up: bool
    reason: str
    model: str | None
    instance: str
    restarts: int
    uptime_s: float | None
    stats_age_s: float | None
    stats_t: float | None
    page_size: int | None
    capacity_tokens: int | None
    counters: dict[str, float]
    gauges: dict[str, float]
    histograms: dict[str, HistogramSnapshot]


class RoleSwitchCount(BaseModel):
    """Completed live role switches of one kind (``pdserve_role_switches_total{from,to,reason}``)."""

    old: str
    new: str
    reason: str
    count: float


class RouterSnapshot(BaseModel):
    """The router's own series: requests by HTTP status (cumulative) and latency histograms; the
    admission stage's requests never forwarded by reason (cumulative), the queue-wait histogram and
    the queue now by API key name, ``[requests, tokens]``; failovers by the worker that died and
    outcome (cumulative), the tokens continuations computed again and the stall clients saw; the
    completed role switches (cumulative; each worker's role now is in its ``WorkerSnapshot``)."""

    inflight: int
    requests: dict[str, float]
    ttft: HistogramSnapshot
    tpot: HistogramSnapshot
    e2e: HistogramSnapshot
    shed: dict[str, float]
    queue_wait: HistogramSnapshot
    queued: dict[str, list[int]]
    failovers: dict[str, dict[str, float]]
    failover_recomputed: float
    failover_stall: HistogramSnapshot
    role_switches: list[RoleSwitchCount]


class DashboardSnapshot(BaseModel):
    """Everything one dashboard refresh shows; ``t`` is the router's monotonic clock (seconds)."""

    version: int = SNAPSHOT_VERSION
    t: float
    time: float
    model: str
    mode: str
    healthy: bool
    health: str
    heartbeat_s: float
    worker_timeout_s: float
    router: RouterSnapshot
    workers: list[WorkerSnapshot]


def display_state(h: WorkerHandle) -> str:
    """The registry's state: starting (never heard from), ready, dead, restarting (the launcher
    started a new process after the old one exited), draining or drained
    (``server.router.workers``)."""
    return h.state


def worker_snapshot(h: WorkerHandle, now: float) -> WorkerSnapshot:
    """The dashboard's view of one registry handle at monotonic time ``now``."""
    s = h.stats
    return WorkerSnapshot(
        id=h.worker_id,
        role=h.spec.role,
        state=display_state(h),
        up=h.state == READY,
        reason=h.reason,
        model=s.model if s else None,
        instance=h.instance,
        restarts=h.restarts,
        uptime_s=now - h.up_since if h.up_since is not None else None,
        stats_age_s=max(0.0, now - h.stats_at) if h.stats_at is not None else None,
        stats_t=h.stats_at,
        page_size=s.page_size if s else None,
        capacity_tokens=s.capacity_tokens if s else None,
        counters=dict(s.counters) if s else {},
        gauges=dict(s.gauges) if s else {},
        histograms={k: HistogramSnapshot(**v.model_dump()) for k, v in s.histograms.items()} if s else {},
    )


def histogram_snapshot(hist: Histogram) -> HistogramSnapshot:
    """A prometheus_client ``Histogram`` (no labels) as non-cumulative bucket counts."""
    edges, cumulative, total = [], [], 0.0
    for fam in hist.collect():
        for sample in fam.samples:
            if sample.name.endswith("_bucket"):
                le = sample.labels["le"]
                if le != "+Inf":
                    edges.append(float(le))
                cumulative.append(int(sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
    counts = [c - p for c, p in zip(cumulative, [0, *cumulative[:-1]])]
    return HistogramSnapshot(buckets=edges, counts=counts, sum=total)


def counter_by_label(counter: Counter, label: str) -> dict[str, float]:
    """``{label value: count}`` of a labelled prometheus_client ``Counter``."""
    return {s.labels[label]: s.value for fam in counter.collect() for s in fam.samples if s.name.endswith("_total")}


def counter_by_two_labels(counter: Counter, outer: str, inner: str) -> dict[str, dict[str, float]]:
    """``{outer value: {inner value: count}}`` of a ``Counter`` labelled with ``outer`` and ``inner``."""
    out: dict[str, dict[str, float]] = {}
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                out.setdefault(s.labels[outer], {})[s.labels[inner]] = s.value
    return out


def role_switch_counts(counter: Counter) -> list[RoleSwitchCount]:
    """Every ``{from,to,reason}`` sample of the role switch counter, sorted by its labels."""
    out = [
        RoleSwitchCount(old=s.labels["from"], new=s.labels["to"], reason=s.labels["reason"], count=s.value)
        for fam in counter.collect()
        for s in fam.samples
        if s.name.endswith("_total")
    ]
    return sorted(out, key=lambda c: (c.old, c.new, c.reason))


def counter_value(counter: Counter) -> float:
    """The value of an unlabelled ``Counter``."""
    return next(s.value for fam in counter.collect() for s in fam.samples if s.name.endswith("_total"))


def snapshot(ctx: RouterContext, clock: Callable[[], float] = time.monotonic) -> DashboardSnapshot:
    """The current dashboard snapshot of ``ctx`` (reads the registry and metrics; changes nothing)."""
    now = clock()
    m = ctx.metrics
    healthy, health = ctx.registry.health()
    router = RouterSnapshot(
        inflight=len(ctx.table),
        requests=counter_by_label(m.requests, "status"),
        ttft=histogram_snapshot(m.ttft),
        tpot=histogram_snapshot(m.tpot),
        e2e=histogram_snapshot(m.e2e),
        shed=counter_by_label(m.shed, "reason"),
        queue_wait=histogram_snapshot(m.queue_wait),
        queued={k: list(v) for k, v in m.queued().items()},
        failovers=counter_by_two_labels(m.failovers, "worker", "outcome"),
        failover_recomputed=counter_value(m.failover_recomputed),
        failover_stall=histogram_snapshot(m.failover_stall),
        role_switches=role_switch_counts(m.role_switches),
    )
    return DashboardSnapshot(
        t=now,
        time=time.time(),
        model=ctx.model_name,
        mode=ctx.cfg.cluster.mode,
        healthy=healthy,
        health=health,
        heartbeat_s=ctx.registry.interval_s,
        worker_timeout_s=ctx.registry.timeout_s,
        router=router,
        workers=[worker_snapshot(h, now) for h in ctx.registry.handles.values()],
    )


def add_dashboard_routes(app: FastAPI, ctx: RouterContext) -> None:
    """Register ``/dashboard``, ``/dashboard/static/{name}`` and ``/dashboard/data`` on ``app``."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        """The dashboard page (no data in it; it fetches ``/dashboard/data``)."""
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers=SECURITY_HEADERS)

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str) -> FileResponse:
        """One of the page's own scripts or styles; 404 for any other name."""
        if name not in ASSETS:
            raise APIError(404, f"no dashboard asset {name!r}; assets: {', '.join(sorted(ASSETS))}", code="not_found")
        return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=SECURITY_HEADERS)

    @app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> JSONResponse:
        """The JSON snapshot (``DashboardSnapshot``); API key required when configured."""
        check_api_key(request, ctx.cfg.server.api_key)
        return JSONResponse(snapshot(ctx).model_dump(), headers={"Cache-Control": "no-store"})
