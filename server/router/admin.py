"""Operator endpoints of the router: ``POST /admin/drain``.

``POST /admin/drain`` with ``{"worker_id": "decode-0"}`` (the API key is required like ``/v1/*``):
the router stops routing new requests to that worker at once and sends it ``Drain``; the worker
finishes what it holds (within its ``drain_timeout_s``) and exits 0. Answers 202 with the worker's
state; 404 naming the known workers for an unknown id; 409 when the worker is not serving.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import check_api_key, parse_model, read_body
from server.router.membership import drain_worker


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


def add_admin_routes(app: FastAPI, ctx: RouterContext) -> None:
    """Register ``POST /admin/drain`` on ``app``."""

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
