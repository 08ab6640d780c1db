"""Multi-turn chat (``bench serve --multi-turn``): ``users`` conversations of ``turns`` turns each.

Every user has its own opening context (``first_len`` tokens); each later turn sends the whole
conversation so far (previous prompt, the answer the server streamed, a new question of
``question_len`` tokens), as a chat client does, after a think time (exponential, mean
``think_s``; 0: none). Users start together (``arrival_s`` 0) or one after another (exponential gaps of
mean ``arrival_s``, seeded: chat sessions arrive over time, so the first turns do not all land in one
burst). Users run concurrently, each one turn at a time, so the prompts of a
conversation share ever longer prefixes: what cache-aware routing is for. A failed turn ends that
user's conversation (the failure is counted; later turns are not sent). Records: one per turn
(``kind`` ``turn1``..) and one over every request (``all``), so TTFT can be read per turn.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import httpx

from bench.serve.client import ClientConfig, RequestResult, send
from bench.serve.report import RunRecord
from bench.serve.runner import Measured, Meter, _bar, _http_client
from bench.serve.server_metrics import CacheEffect, cache_effect, scrape
from bench.serve.stats import SLO, compute_stats
from bench.serve.workload import LengthCounter, RequestSpec, poisson_offsets

HEARTBEAT_WAIT_S = 2.5  # workers' counters reach /metrics with their next heartbeat (default every 1 s)


@dataclass(frozen=True)
class MultiTurnSpec:
    """Shape of the multi-turn workload (see the module docstring)."""

    users: int
    turns: int
    first_len: int
    question_len: int
    output_len: int
    think_s: float = 1.0
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        if self.users < 1 or self.turns < 1 or self.first_len < 1 or self.question_len < 1 or self.output_len < 1:
            raise ValueError("--users, --turns, --input-len, --turn-input-len and --output-len must be >= 1")
        if self.think_s < 0:
            raise ValueError(f"--think-time-s must be >= 0, got {self.think_s}")
        if self.arrival_s < 0:
            raise ValueError(f"--user-arrival-s must be >= 0, got {self.arrival_s}")


def user_starts(spec: MultiTurnSpec, seed: int) -> list[float]:
    """Seconds from the run's start to each user's first turn: all 0 for ``arrival_s`` 0, else the
    sums of exponential gaps of mean ``arrival_s`` (the first user at 0); deterministic per seed."""
    return poisson_offsets(spec.users, 1 / spec.arrival_s if spec.arrival_s else math.inf, seed + 2)


def conversation_texts(spec: MultiTurnSpec, counter: LengthCounter, seed: int) -> list[list[str]]:
    """Per user, the new text of each turn (the opening context, then the questions); deterministic."""
    rng = random.Random(seed)
    return [
        [counter.make_text(spec.first_len if t == 0 else spec.question_len, rng) for t in range(spec.turns)]
        for _ in range(spec.users)
    ]


def turn_request(
    cfg: ClientConfig, index: int, turn: int, history: list[tuple[str, str]], output_len: int, counter: LengthCounter
) -> RequestSpec:
    """The request of ``turn`` (0-based) given the conversation so far (``(role, text)`` pairs, the
    new question last): chat sends the messages; completions sends the text so far, each answer
    right after the prompt it continues (as the server produced it: the answer's tokens then follow
    the previous prompt's, so a cache that holds the previous turn's prompt and output matches) and
    each user text on a new line."""
    prompt = "".join(text if role == "assistant" or i == 0 else "\n" + text for i, (role, text) in enumerate(history))
    messages = tuple(history) if cfg.endpoint == "chat" else None
    return RequestSpec(index, prompt, counter.count(prompt), output_len, kind=f"turn{turn + 1}", messages=messages)


async def run_conversations(
    cfg: ClientConfig,
    spec: MultiTurnSpec,
    counter: LengthCounter,
    seed: int,
    progress: bool = True,
    client: httpx.AsyncClient | None = None,
) -> Measured:
    """Run every user's conversation concurrently; returns every turn's result and the wall time.
    ``client``: the HTTP client to send with (default: one sized for ``spec.users``)."""
    texts = conversation_texts(spec, counter, seed)
    rng = random.Random(seed + 1)
    thinks = [
        [rng.expovariate(1 / spec.think_s) if spec.think_s else 0.0 for _ in range(spec.turns)]
        for _ in range(spec.users)
    ]
    starts = user_starts(spec, seed)
    results: list[RequestResult] = []
    async with client or _http_client(spec.users) as client:
        bar = _bar(spec.users * spec.turns, "multi-turn", progress)

        async def user(u: int) -> None:
            history: list[tuple[str, str]] = []
            if starts[u]:
                await asyncio.sleep(starts[u])
            for t in range(spec.turns):
                history.append(("user", texts[u][t]))
                r = await send(client, cfg, turn_request(cfg, u * spec.turns + t, t, history, spec.output_len, counter))
                results.append(r)
                bar.update(1)
                if not r.ok:
                    return
                history.append(("assistant", r.output_text))
                if t + 1 < spec.turns and thinks[u][t]:
                    await asyncio.sleep(thinks[u][t])

        t0 = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(spec.users)))
        duration = time.perf_counter() - t0
        bar.close()
    return Measured(sorted(results, key=lambda r: r.index), duration)


def run_multi_turn(
    cfg: ClientConfig,
    spec: MultiTurnSpec,
    counter: LengthCounter,
    seed: int,
    progress: bool,
    meter: Meter | None = None,
) -> tuple[Measured, CacheEffect]:
    """Run the conversations against ``cfg.base_url`` and read its ``/metrics`` before and after
    (``HEARTBEAT_WAIT_S`` after the last turn) for the prefix hit rates and KV bytes shipped."""
    before = scrape(cfg.base_url)
    if meter is not None:
        meter.start()
    measured = asyncio.run(run_conversations(cfg, spec, counter, seed, progress))
    if meter is not None:
        meter.stop()
    time.sleep(HEARTBEAT_WAIT_S)
    return measured, cache_effect(before, scrape(cfg.base_url), len(measured.results))


def multi_turn_records(target: str, measured: Measured, slo: SLO, turns: int) -> list[RunRecord]:
    """One record per turn (``turn1``..) and one over every request (``all``), load "multi-turn"."""
    out = [
        RunRecord(
            target,
            "multi-turn",
            None,
            None,
            compute_stats(measured.results, measured.duration_s, slo),
            measured.results,
        )
    ]
    for t in range(1, turns + 1):
        rs = [r for r in measured.results if r.kind == f"turn{t}"]
        out.append(
            RunRecord(
                target, "multi-turn", None, None, compute_stats(rs, measured.duration_s, slo), rs, kind=f"turn{t}"
            )
        )
    return out
