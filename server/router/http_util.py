"""HTTP-layer helpers: bounded body reading, JSON parsing into request models, auth, disconnects."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from configs.api_keys import parse_api_keys
from server.router.admission import DEFAULT_KEY
from server.router.errors import APIError, from_validation_error

M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; a 413 ``APIError`` as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    too_big = APIError(
        413,
        f"request body is larger than the server's limit of {limit} bytes (max_body_bytes)",
        code="request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def parse_object(body: bytes) -> dict:
    """A JSON object body as a dict; 400 ``APIError`` if it is not valid JSON or not an object."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def parse_model(model: type[M], body: bytes | dict) -> M:
    """Parse a JSON object body (or its ``parse_object`` dict) into ``model``; 400 ``APIError``
    naming the problem otherwise."""
    data = body if isinstance(body, dict) else parse_object(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def check_api_key(request: Request, api_key: str | None) -> str:
    """The public name of the key the request presents (``key-<i>``, see ``configs.api_keys``), or
    ``DEFAULT_KEY`` when no key is configured; 401 ``APIError`` unless the request has
    ``Authorization: Bearer <one of the keys>``. Every key is compared (constant time each)."""
    keys = parse_api_keys(api_key)
    if not keys:
        return DEFAULT_KEY
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    matches = [k.name for k in keys if hmac.compare_digest(given, k.secret.encode())]
    if scheme.lower() != "bearer" or not matches:
        raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")
    return matches[0]


async def until_disconnected(request: Request, poll_s: float = 0.25) -> None:
    """Return once the client has disconnected (polls ``request.is_disconnected()``)."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


async def unless_disconnected(request: Request, work: Awaitable) -> object:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
