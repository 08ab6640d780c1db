"""The overload tests' client side (tests/chaos/test_overload.py, and ``heavy_load.py`` in a
process of its own): streamed completions recorded as ``Shot``s, closed-loop and Poisson loads
under an API key, RSS sampling, percentiles, and the check every outcome must pass."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tests.chaos.chaos_cluster import rss_bytes

HEAVY, LIGHT = "heavy-secret", "light-secret"
WORDS = (
    "river stone light garden window morning paper music silver forest engine voice winter harbor "
    "letter market bridge candle orange summer"
).split()


@dataclass
class Shot:
    """One streamed request as the client saw it (monotonic seconds)."""

    key: str
    max_tokens: int
    t_start: float
    status: int | None = None
    t_head: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    retry_after: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start


def make_prompt(rng: random.Random) -> tuple[str, int]:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60))), rng.choice([4, 16, 48])


async def shoot(c: httpx.AsyncClient, prompt: str, max_tokens: int, key: str = HEAVY) -> Shot:
    """One greedy streamed completion with ``ignore_eos`` (so a 200 means exactly ``max_tokens`` tokens)."""
    s = Shot(key, max_tokens, time.monotonic())
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    try:
        async with c.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            s.status, s.t_head, s.retry_after = r.status_code, time.monotonic(), r.headers.get("retry-after")
            if r.status_code != 200:
                s.error = json.loads(await r.aread())["error"]["message"]
            else:
                await _read(r, s)
    except httpx.HTTPError as e:
        s.error = f"transport error: {type(e).__name__}: {e}"
    s.t_end = time.monotonic()
    return s


async def _read(r: httpx.Response, s: Shot) -> None:
    async for line in r.aiter_lines():
        data = line.removeprefix("data: ")
        if not line.startswith("data: ") or data == "[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            s.error = event["error"]["message"]
        for ch in event.get("choices", ()):
            if ch.get("token_ids") and s.t_first is None:
                s.t_first = time.monotonic()
            s.tokens += ch.get("token_ids") or []


def client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=1000), trust_env=False)


async def closed_loop(url: str, n: int, concurrency: int, rng: random.Random) -> tuple[list[Shot], float]:
    """``n`` requests, ``concurrency`` at a time; (shots, elapsed seconds)."""
    work = iter([make_prompt(rng) for _ in range(n)])
    shots: list[Shot] = []
    async with client(url) as c:

        async def worker():
            for p, m in work:
                shots.append(await shoot(c, p, m))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return shots, time.monotonic() - t0


async def poisson(c: httpx.AsyncClient, rate: float, duration: float, rng: random.Random, key: str = HEAVY) -> list:
    """Open loop: Poisson arrivals at ``rate``/s for ``duration`` s; every request's task."""
    tasks, end = [], time.monotonic() + duration
    while (now := time.monotonic()) < end:
        tasks.append(asyncio.create_task(shoot(c, *make_prompt(rng), key=key)))
        await asyncio.sleep(min(rng.expovariate(rate), end - now))
    return tasks


async def sample_rss(pids: dict[str, int], out: list, every_s: float = 0.5) -> None:
    while True:
        out.append((time.monotonic(), {n: rss_bytes(p) for n, p in pids.items()}))
        await asyncio.sleep(every_s)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def check_outcomes(shots: list[Shot]) -> Counter:
    """Only 200 / 429 / 504; a 200 has all its tokens and no error event; a 429 has Retry-After."""
    statuses = Counter(s.status for s in shots)
    assert set(statuses) <= {200, 429, 504}, [(s.status, s.error) for s in shots if s.status not in (200, 429, 504)][:5]
    bad = [s for s in shots if s.status == 200 and (s.error or len(s.tokens) != s.max_tokens)]
    assert not bad, [(b.error, len(b.tokens), b.max_tokens) for b in bad[:5]]
    assert all(s.retry_after and int(s.retry_after) >= 1 for s in shots if s.status == 429)
    return statuses
