"""Serving a list of choices as one OpenAI response, streamed (SSE) or not.

``serve_choices`` owns the sessions from here on: every path (success, error, client gone,
timeout) closes all of them, so each request leaves the in-flight table and its KV is freed.
Endpoint-specific JSON shapes come from a ``ResponseFormat``.

Streaming: the first piece of every choice is awaited before the HTTP response starts, so early
failures (refused by the worker, no worker) still get their proper HTTP status. Errors after that
are sent as an SSE event ``data: {"error": {...}}`` followed by ``data: [DONE]``. With
``usage_every_chunk`` (vLLM's ``continuous_usage_stats``) every chunk that has choices also
carries ``usage`` counted up to and including that chunk.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.router.admission import DEFAULT_KEY, Demand, Grant, Refused, retry_after_headers
from server.router.choices import ChoiceRun, Piece, merge
from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import ClientGone, unless_disconnected

CLIENT_GONE = 499


class ResponseFormat(Protocol):
    """Builds an endpoint's JSON objects from its choices."""

    def full(self, runs: list[ChoiceRun]) -> dict:
        """The non-streaming response body."""

    def opening(self, runs: list[ChoiceRun]) -> list[dict]:
        """Chunks sent before the first piece (chat: the role delta; completions: echo)."""

    def chunks(self, run: ChoiceRun, piece: Piece) -> list[dict]:
        """The chunks for one piece (possibly none)."""

    def closing(self, runs: list[ChoiceRun]) -> list[dict]:
        """Chunks after the last piece (the usage chunk when asked for)."""


def sse(obj: dict | str) -> str:
    """One SSE event: ``data: <json>\\n\\n`` (strings are sent as they are, e.g. ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


async def gather_all(aws: Iterable[Awaitable]) -> list:
    """Like ``asyncio.gather`` but the first exception cancels the others (and so does cancellation)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _close_all(runs: list[ChoiceRun], reason: str) -> None:
    for r in runs:
        r.session.close(reason)


def _record_success(ctx: RouterContext, runs: list[ChoiceRun]) -> None:
    for r in runs:
        ctx.metrics.observe_latency(*r.session.latency())


class SessionStream(StreamingResponse):
    """A ``StreamingResponse`` that closes its sessions and counts its outcome when it ends,
    however it ends (normal end, client disconnect, server shutdown)."""

    def __init__(
        self, body: AsyncIterator[str], ctx: RouterContext, runs: list[ChoiceRun], outcome: dict, grant: Grant
    ) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._ctx, self._runs, self._outcome, self._grant = ctx, runs, outcome, grant

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            _close_all(self._runs, "client disconnected")
            status = self._outcome["status"]
            self._ctx.admission.release(self._grant, drained=status == 200)
            self._ctx.metrics.observe_request(status)
            if status == 200:
                _record_success(self._ctx, self._runs)


def _usage_so_far(runs: list[ChoiceRun], enabled: bool):
    """``add(run, piece)`` counts a piece's tokens; ``stamp(chunk)`` adds its choice's usage so far
    (that choice's prompt and completion tokens, as vLLM's ``continuous_usage_stats``) when
    ``enabled``, else returns the chunk as it is."""
    prompt = {r.index: len(r.session.prompt_ids) for r in runs}
    done = dict.fromkeys(prompt, 0)

    def add(run: ChoiceRun, piece: Piece) -> None:
        done[run.index] += len(piece.ids)

    def stamp(chunk: dict) -> dict:
        if not enabled or not chunk["choices"]:
            return chunk
        i = chunk["choices"][0]["index"]
        return {
            **chunk,
            "usage": {"prompt_tokens": prompt[i], "completion_tokens": done[i], "total_tokens": prompt[i] + done[i]},
        }

    return add, stamp


async def _events(
    runs: list[ChoiceRun], first: list[Piece], fmt: ResponseFormat, outcome: dict, usage_every_chunk: bool
):
    add, stamp = _usage_so_far(runs, usage_every_chunk)
    try:
        for c in fmt.opening(runs):
            yield sse(stamp(c))
        for run, piece in zip(runs, first):
            add(run, piece)
            for c in fmt.chunks(run, piece):
                yield sse(stamp(c))
        async for run, piece in merge(runs):
            add(run, piece)
            for c in fmt.chunks(run, piece):
                yield sse(stamp(c))
        for c in fmt.closing(runs):
            yield sse(c)
        outcome["status"] = 200
    except APIError as e:
        outcome["status"] = e.status
        yield sse(e.body())
    yield sse("[DONE]")


def _start(runs: list[ChoiceRun]) -> None:
    try:
        for r in runs:  # leaders first: a follower shares its leader's route and is sent by its first step
            if r.follows is None:
                r.session.prepare()
        for r in runs:
            if r.follows is not None:
                r.session.prepare(r.follows.session.route)
        for r in runs:
            if r.follows is None:
                r.session.send()
    except BaseException:
        _close_all(runs, "request refused")
        raise


def demand_of(request: Request, runs: list[ChoiceRun], priority: int) -> Demand:
    """The admission ``Demand`` of one HTTP request: its API key's name (set by the route on
    ``request.state.api_key_name``), one slot and prompt + max_tokens per choice, the earliest deadline."""
    return Demand(
        key=getattr(request.state, "api_key_name", DEFAULT_KEY),
        priority=priority,
        slots=len(runs),
        tokens=sum(len(r.session.prompt_ids) + r.session.params.max_new_tokens for r in runs),
        deadline=min(r.session.arrival + r.session.timeout_s for r in runs),
    )


def refuse_early(ctx: RouterContext, request: Request, body: dict) -> None:
    """The fast 429: raise the admission stage's refusal (an ``APIError`` with ``Retry-After``)
    when it is certain from the API key, ``priority`` and ``max_tokens`` of the raw JSON ``body``
    alone, before the body is validated or tokenized (``Admission.refuse_early``). A body whose
    ``priority`` is not a plain in-range integer is left to validation (400)."""
    priority = body.get("priority", 0)
    if type(priority) is not int or not -(2**31) <= priority < 2**31:
        return
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        ctx.admission.refuse_early(
            getattr(request.state, "api_key_name", DEFAULT_KEY),
            priority,
            max_tokens if type(max_tokens) is int and max_tokens > 0 else 1,
        )
    except Refused as e:
        raise _api_error(e) from None


def _api_error(e: Refused) -> APIError:
    headers = retry_after_headers(e.retry_after_s) if e.retry_after_s is not None else None
    return APIError(e.status, e.message, code=e.reason, headers=headers)


async def admit(ctx: RouterContext, request: Request, demand: Demand) -> Grant:
    """A grant from ``ctx.admission`` (waiting in its queue, watching for the client going away);
    a refusal becomes a 429 (with ``Retry-After`` / ``retry-after-ms``) or 504 ``APIError``; raises
    ``ClientGone`` when the client left while queued."""
    if (grant := ctx.admission.try_grant(demand)) is not None:
        return grant
    try:
        return await unless_disconnected(request, ctx.admission.admit(demand))
    except Refused as e:
        raise _api_error(e) from None
    except ClientGone:
        ctx.metrics.observe_shed("client_gone")
        raise


async def serve_choices(
    ctx: RouterContext,
    request: Request,
    runs: list[ChoiceRun],
    stream: bool,
    fmt: ResponseFormat,
    usage_every_chunk: bool = False,
    *,
    priority: int = 0,
) -> Response:
    """Pass admission (``ctx.admission``), run ``runs`` and answer. Raises ``APIError`` for failures
    before any byte is sent (429/504 from admission included: nothing reached a worker then).

    Non-streaming responses are counted in the metrics by the caller; a ``SessionStream``
    counts itself when it ends. The admission grant is released when the request ends, however.
    """
    try:
        grant = await admit(ctx, request, demand_of(request, runs, priority))
    except ClientGone:
        return Response(status_code=CLIENT_GONE)
    for r in runs:  # a PD decode worker with a full batch retracts an over-share key's request for it
        r.session.preempt = grant.preempt
    streaming = ok = False
    try:
        response = await _serve(ctx, request, runs, stream, fmt, grant, usage_every_chunk)
        streaming, ok = isinstance(response, SessionStream), response.status_code == 200
        return response
    finally:
        if not streaming:  # a SessionStream releases its grant when it ends
            ctx.admission.release(grant, drained=ok)


async def _serve(
    ctx: RouterContext,
    request: Request,
    runs: list[ChoiceRun],
    stream: bool,
    fmt: ResponseFormat,
    grant: Grant,
    usage_every_chunk: bool,
) -> Response:
    _start(runs)
    try:
        if not stream:
            await unless_disconnected(request, gather_all(r.collect() for r in runs))
            _record_success(ctx, runs)
            return JSONResponse(fmt.full(runs))
        first = await unless_disconnected(request, gather_all(r.step() for r in runs))
    except ClientGone:
        _close_all(runs, "client disconnected")
        return Response(status_code=CLIENT_GONE)
    except BaseException:
        _close_all(runs, "request failed")
        raise
    finally:
        if not stream:
            _close_all(runs, "request ended")
    outcome = {"status": CLIENT_GONE}
    return SessionStream(_events(runs, first, fmt, outcome, usage_every_chunk), ctx, runs, outcome, grant)
