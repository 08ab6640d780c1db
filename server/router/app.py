"""The router's FastAPI app: OpenAI-compatible endpoints, health and metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /detokenize`` (these need ``Authorization: Bearer <api_key>`` when
an API key is configured; ``server/router/tokenize.py``), ``GET /version``, and ``GET /health``,
``GET /metrics`` (always open, so load balancers and Prometheus need no secret; they expose no
request content), and the live dashboard ``GET /dashboard`` whose data, ``GET /dashboard/data``,
needs the API key like ``/v1/*`` (``server/router/dashboard.py``), and ``POST /admin/drain`` (API key
required; ``server/router/admin.py``). Every error has OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``. The app's lifespan starts and stops the worker registry (connections, heartbeats) and,
with ``cluster.discovery``, the watches that add and remove workers (``server/router/discovery_watch.py``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

import zmq.asyncio
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from configs.api_keys import parse_api_keys
from configs.schema import PdserveConfig
from engine.tokenizer import Tokenizer
from server.router.admin import add_admin_routes
from server.router.admission import DEFAULT_KEY, Admission, AdmissionLimits, default_inflight_per_worker
from server.router.cache_routing import CacheAwarePolicy
from server.router.chat import create_chat_completion
from server.router.common import served_max_model_len
from server.router.completions import create_completion
from server.router.context import RouterContext
from server.router.dashboard import add_dashboard_routes
from server.router.discovery_watch import watches
from server.router.errors import APIError
from server.router.fair_headroom import FairHeadroom, default_fair_headroom
from server.router.http_util import check_api_key, parse_object, read_body
from server.router.inflight import InflightTable
from server.router.kv_index import KvIndex
from server.router.kv_metrics import KvIndexCollector
from server.router.kv_subscriber import KvSubscriber
from server.router.load import PrefillBacklog
from server.router.metrics import CONTENT_TYPE, RouterMetrics
from server.router.openapi import openapi_document
from server.router.planner_task import Planner, knobs_of, views_of
from server.router.registry import READY, ROUTING_POLICIES, Registry, WorkerSpec
from server.router.serving import SessionStream, refuse_early
from server.router.tokenize import add_tokenize_routes
from server.router.worker_client import WorkerClient
from server.router.workers import pinned_pd
from transfer.control_auth import ControlAuth
from transfer.wire.enums import Role

log = logging.getLogger(__name__)

Handler = Callable[[RouterContext, Request, dict], Awaitable[Response]]


def zmq_client_factory(zctx: zmq.asyncio.Context, auth: ControlAuth) -> Callable[..., WorkerClient]:
    """A registry ``client_factory`` building one ``WorkerClient`` per spec on ``zctx``, each
    authenticated by ``auth`` (the cluster key)."""

    def factory(spec: WorkerSpec, on_tokens, on_stats) -> WorkerClient:
        return WorkerClient(spec.worker_id, spec.addr, zctx, on_tokens, on_stats, auth=auth)

    return factory


def build_context(
    cfg: PdserveConfig,
    tokenizer: Tokenizer,
    model_name: str,
    specs: list[WorkerSpec],
    client_factory: Callable[..., object],
    *,
    auth: ControlAuth | None = None,
    zctx: zmq.asyncio.Context | None = None,
) -> RouterContext:
    """Wire registry, in-flight table and metrics for ``specs`` (nothing connects until startup).
    With ``cluster.routing == "cache-aware"``, also the KV index, its subscriber (on ``zctx``,
    authenticated by ``auth``; insecure when None) and the cache-aware policy, unless
    ``server.route_decode`` pins every PD request's decode worker (the pin wins over any policy)."""
    table = InflightTable()
    pinned = cfg.cluster.mode == "pd" and bool(cfg.server.route_decode)
    policy = pinned_pd(cfg.server.route_decode) if pinned else ROUTING_POLICIES[cfg.cluster.mode]
    registry = Registry(
        specs,
        client_factory,
        table,
        policy=policy,
        interval_s=cfg.server.health_interval_s,
        timeout_s=cfg.server.worker_timeout_s,
        model_name=model_name,
        cluster_id=cfg.cluster.cluster_id or "",
        dynamic=bool(cfg.cluster.discovery),
    )
    admission = build_admission(cfg, registry)
    keys = [k.name for k in parse_api_keys(cfg.server.api_key)] or [DEFAULT_KEY]

    def queued() -> dict[str, tuple[int, int]]:
        return {**{k: (0, 0) for k in keys}, **admission.queued_by_key()}

    metrics = RouterMetrics(
        lambda: registry.handles.values(), lambda: len(table), queued, table.outstanding, table.continuations
    )
    admission.on_refused = lambda refused: metrics.observe_shed(refused.reason)
    admission.on_granted = lambda grant: metrics.queue_wait.observe(grant.waited_s)
    subscriber = None
    if cfg.cluster.routing == "cache-aware" and not pinned:
        index = KvIndex()
        registry.policy = CacheAwarePolicy(
            index,
            backlog=PrefillBacklog(table, registry.handles),
            balance_slack=cfg.cluster.routing_balance_slack,
            on_decision=metrics.observe_routing,
        )
        subscriber = KvSubscriber(index, lambda: registry.handles, auth or ControlAuth.insecure(), zctx)
        metrics.registry.register(KvIndexCollector(subscriber))
    return RouterContext(cfg, tokenizer, model_name, registry, table, metrics, admission, subscriber)


def build_admission(cfg: PdserveConfig, registry: Registry) -> Admission:
    """The admission stage of ``cfg.server``'s limits: ``max_inflight_per_worker`` (default
    ``default_inflight_per_worker(max_running_requests)``: the batch plus a small margin)
    forwarding slots per ready worker that streams tokens (decode or colocated), the API keys'
    shares, and ``fair_headroom_per_worker`` slots per such worker kept for keys under their share
    (default ``default_fair_headroom``); in PD mode with ``fair_preemption`` a key under its share
    is granted past the bound (its decode worker preempts for it)."""
    server, running = cfg.server, cfg.scheduler.max_running_requests
    per_worker = server.max_inflight_per_worker or default_inflight_per_worker(running)
    per_worker_headroom = server.fair_headroom_per_worker
    if per_worker_headroom is None:
        per_worker_headroom = default_fair_headroom(per_worker, running)

    def streaming_workers() -> int:
        return sum(
            1 for h in registry.handles.values() if h.state == READY and h.spec.role in (Role.DECODE, Role.COLOCATED)
        )

    limits = AdmissionLimits(server.max_queued_requests, server.max_queued_tokens, server.max_queue_wait_s)
    return Admission(
        limits,
        lambda: per_worker * streaming_workers(),
        shares={k.name: k.share for k in parse_api_keys(server.api_key)},
        headroom=FairHeadroom(
            lambda: per_worker_headroom * streaming_workers(),
            preempt=server.fair_preemption and cfg.cluster.mode == "pd",
        ),
    )


async def _pump(ctx: RouterContext) -> None:
    """Let queued requests go when workers become ready (capacity grows without a release)."""
    while True:
        await asyncio.sleep(ctx.cfg.server.health_interval_s)
        ctx.admission.pump()


def _planner(ctx: RouterContext) -> Planner:
    """The SLO planner over ``ctx``'s workers; its switches wait as long as ``POST /admin/role``'s."""
    timeout_s = ctx.cfg.cluster.drain_timeout_s + 10 * ctx.cfg.server.health_interval_s
    return Planner(ctx.registry, ctx.metrics, knobs_of(ctx.cfg.server), timeout_s, views=views_of(ctx.cfg.server))


def _generation_route(ctx: RouterContext, handler: Handler):
    async def endpoint(request: Request) -> Response:
        """Auth, bounded body, the handler; every outcome is counted in pdserve_requests_total."""
        try:
            request.state.api_key_name = check_api_key(request, ctx.cfg.server.api_key)
            body = parse_object(await read_body(request, ctx.cfg.server.max_body_bytes))
            refuse_early(ctx, request, body)  # a certain 429 goes out before validation and tokenization
            response = await handler(ctx, request, body)
        except APIError as e:
            ctx.metrics.observe_request(e.status)
            return e.response()
        if not isinstance(response, SessionStream):  # a stream counts itself when it ends
            ctx.metrics.observe_request(response.status_code)
        return response

    return endpoint


def _add_routes(app: FastAPI, ctx: RouterContext) -> None:
    app.add_api_route("/v1/completions", _generation_route(ctx, create_completion), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _generation_route(ctx, create_chat_completion), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        """The one served model (API key required when configured)."""
        check_api_key(request, ctx.cfg.server.api_key)
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": served_max_model_len(ctx),
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(require: Literal["all", "any"] = "all") -> JSONResponse:
        """200 when every worker is ready (``?require=any``: when a request can be routed, e.g. one
        prefill and one decode worker are ready), else 503; ``workers`` says each one's state."""
        ok, detail = ctx.registry.health()
        if require == "any":
            ok = ctx.registry.can_route()
        body = {"status": "ok" if ok else "unavailable", "workers": detail}
        if ctx.registry.notes:  # discovery: watching, or unavailable and keeping the last membership
            body["discovery"] = "; ".join(ctx.registry.notes.values())
        return JSONResponse(body, status_code=200 if ok else 503)

    document = openapi_document(_version())

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        """The OpenAPI document of the routes above (``server.router.openapi``)."""
        return JSONResponse(document)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition of router and worker series."""
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, msg).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()


def create_app(ctx: RouterContext) -> FastAPI:
    """The FastAPI app for ``ctx``; its lifespan starts and closes ``ctx.registry``."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await ctx.registry.start()
        c = ctx.cfg.cluster
        found = watches(c.discovery, ctx.registry, c.discovery_interval_s, c.discovery_lease_s)
        for w in found:
            await w.prepare()
        tasks = [asyncio.create_task(w.run(), name=f"discovery {w.source}") for w in found]
        tasks.append(asyncio.create_task(_pump(ctx), name="admission-pump"))
        if ctx.kv_subscriber is not None:
            tasks.append(asyncio.create_task(ctx.kv_subscriber.run(), name="kv-event-feeds"))
        if ctx.cfg.server.planner == "slo":
            tasks.append(asyncio.create_task(_planner(ctx).run(ctx.cfg.server.planner_interval_s), name="planner"))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await ctx.registry.close()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    _add_routes(app, ctx)
    add_dashboard_routes(app, ctx)
    add_admin_routes(app, ctx)
    add_tokenize_routes(app, ctx, _version())
    _add_error_handlers(app)
    return app
