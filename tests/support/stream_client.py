"""The client side of a streamed load: one ``/v1/completions`` request over httpx recorded as an
``Outcome`` (tokens, HTTP status, error message, when it ended). Shared by the chaos suite and the
compose deployment test."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    """How one request ended: its tokens, the HTTP status (200 also for an error event inside the
    stream), the error message if any, and ``t_end`` (monotonic s)."""

    prompt: int
    tokens: list[int] = field(default_factory=list)
    status: int | None = None
    error: str | None = None
    t_end: float = 0.0


async def stream_one(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, index: int = 0, first: asyncio.Event | None = None
) -> Outcome:
    """One greedy streamed completion (``ignore_eos``: exactly ``max_tokens`` tokens unless it fails);
    ``first`` is set at its first token, or when it ends without one."""
    out = Outcome(index)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = json.loads(await r.aread())["error"]["message"]
            else:
                await _read_events(r, out, first)
    except httpx.HTTPError as e:
        out.error = f"transport error: {type(e).__name__}: {e}"
    if first is not None:
        first.set()
    out.t_end = time.monotonic()
    return out


async def _read_events(r: httpx.Response, out: Outcome, first: asyncio.Event | None) -> None:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            out.error = event["error"]["message"] or "(empty error message)"
            continue
        for c in event["choices"]:
            out.tokens += c.get("token_ids") or []
        if out.tokens and first is not None:
            first.set()
    if not done and out.error is None:
        out.error = "stream ended without [DONE]"
