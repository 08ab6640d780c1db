"""Operator endpoints of the router: ``POST /admin/drain`` and ``POST /admin/role``.

``POST /admin/drain`` with ``{"worker_id": "decode-0"}`` (the API key is required like ``/v1/*``):
the router stops routing new requests to that worker at once and sends it ``Drain``; the worker
finishes what it holds (within its ``drain_timeout_s``) and exits 0. Answers 202 with the worker's
state; 404 naming the known workers for an unknown id; 409 when the worker is not serving.

``POST /admin/role`` with ``{"worker": "decode-1", "role": "prefill"}`` (the API key likewise):
switch a PD worker's role at runtime (``server.router.roles``). Answers 200 with ``RoleAnswer``
once the worker serves in its new role; 404 for an unknown worker; 409 with the reason when the
switch is refused (it would leave a role empty, the worker is not ready, ...) or not made.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import check_api_key, parse_model, read_body
from server.router.membership import drain_worker
from server.router.roles import SwitchRefused, switch_role
from transfer.wire.enums import Role


class DrainBody(BaseModel):
    """The body of ``POST /admin/drain``."""

    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(min_length=1, description="the worker to drain, as /health names it")
    reason: str = Field("drain requested through the router's /admin/drain", max_length=500)


class DrainAnswer(BaseModel):
    """The 202 answer of ``POST /admin/drain``: the worker's state once the router took it out of
    rotation, and how many requests it still holds (they finish; none is cut)."""

    worker_id: str
    state: str = Field(description="the worker's state in the router, 'draining' once accepted")
    in_flight: int = Field(ge=0, description="requests this router still has on that worker")


class RoleBody(BaseModel):
    """The body of ``POST /admin/role``."""

    model_config = ConfigDict(extra="forbid")
    worker: str = Field(min_length=1, description="the worker to switch, as /health names it")
    role: Literal["prefill", "decode"] = Field(description="its new role")


class RoleAnswer(BaseModel):
    """The 200 answer of ``POST /admin/role``: the switch is done and the worker serves in ``role``."""

    worker: str
    previous_role: str
    role: str
    seconds: float = Field(ge=0, description="from the request to the worker ready in its new role")


def add_admin_routes(app: FastAPI, ctx: RouterContext) -> None:
    """Register ``POST /admin/drain`` and ``POST /admin/role`` on ``app``."""

    @app.post("/admin/role", include_in_schema=False)  # stated in server.router.openapi
    async def role(request: Request) -> JSONResponse:
        """Switch a worker's role at runtime (see the module docstring)."""
        check_api_key(request, ctx.cfg.server.api_key)
        body = parse_model(RoleBody, await read_body(request, ctx.cfg.server.max_body_bytes))
        timeout_s = ctx.cfg.cluster.drain_timeout_s + 10 * ctx.cfg.server.health_interval_s
        try:
            done = await switch_role(ctx.registry, body.worker, Role(body.role), timeout_s)
        except SwitchRefused as e:
            code = "unknown_worker" if e.status == 404 else "role_switch_refused"
            raise APIError(e.status, f"cannot switch role: {e}", param="worker", code=code) from None
        ctx.metrics.observe_role_switch(done.old, done.new, "admin")
        answer = RoleAnswer(worker=done.worker_id, previous_role=done.old, role=done.new, seconds=done.seconds)
        return JSONResponse(answer.model_dump())

    @app.post("/admin/drain", include_in_schema=False)  # stated in server.router.openapi
    async def drain(request: Request) -> JSONResponse:
        """Take a worker out of rotation and drain it (see the module docstring)."""
        check_api_key(request, ctx.cfg.server.api_key)
        body = parse_model(DrainBody, await read_body(request, ctx.cfg.server.max_body_bytes))
        try:
            h = drain_worker(ctx.registry, body.worker_id, body.reason)
        except KeyError:
            known = ", ".join(sorted(ctx.registry.handles)) or "none"
            raise APIError(
                404, f"no worker {body.worker_id!r}; known workers: {known}", param="worker_id", code="unknown_worker"
            ) from None
        except ValueError as e:
            raise APIError(409, f"cannot drain: {e}", param="worker_id", code="worker_not_serving") from None
        answer = DrainAnswer(
            worker_id=h.worker_id, state=h.state, in_flight=ctx.table.outstanding_requests(h.worker_id)
        )
        return JSONResponse(answer.model_dump(), status_code=202)
