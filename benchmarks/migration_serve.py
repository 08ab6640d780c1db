"""The serve part of ``benchmarks.migration_bench`` (its serve goal): one ``pdserve launch --mode pd
--decode N --route-decode decode-0`` run without and one with migration on the same streamed
prompts, each request's e2e and longest token gap, and the goal's two P99 ratios (see
``benchmarks.migration_bench``'s docstring for the shape and the bound)."""

from __future__ import annotations

import asyncio
import os
import random
import shlex
import statistics
import time

QUESTIONS = [
    "why the sky is blue",
    "who built the pyramids",
    "photosynthesis",
    "Mount Everest",
    "the fall of the Roman Empire",
    "how volcanoes form",
    "what causes tides",
    "why leaves change color",
]
SHARED = "Write a long, detailed essay of at least ten paragraphs. Topic: "
LONG_PREFIX = "You are a careful writer who never stops early and covers every angle of a subject. "


def long_prefix(words: int) -> str:
    """The long requests' prompt head: ``LONG_PREFIX``, after ``words`` words of background notes
    when ``words`` > 0 (a document-sized prompt: its KV holds most of a pool from its first step)."""
    if words <= 0:
        return LONG_PREFIX
    notes: list[str] = []
    for i in range(words):
        notes += (
            f"Note {i + 1}: the report must explain {QUESTIONS[i % len(QUESTIONS)]} with dates, names, "
            "causes and consequences."
        ).split()
        if len(notes) >= words:
            break
    return "Background for a long report. " + " ".join(notes[:words]) + "\n\n" + LONG_PREFIX


# ---- 2. serve: P99 of retracted requests without / with migration ----------------------------------
async def _one(client, model: str, prompt: str, max_tokens: int, start_after_s: float = 0.0) -> dict:
    """One streamed greedy completion, sent ``start_after_s`` from now; its e2e counts from the send."""
    await asyncio.sleep(start_after_s)
    t0 = time.monotonic()
    stamps, ids, error = [], [], None
    try:
        r = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        async for chunk in r:
            got = (getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else []
            if got:
                ids += got
                stamps.append(time.monotonic())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        error = str(e)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"e2e": time.monotonic() - t0, "ids": ids, "error": error, "max_gap": max(gaps, default=0.0), "gaps": gaps}


def _cpus(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def split_decode_cpus(n: int, decode: int = 2) -> list[str]:
    """``--worker-cpus`` giving decode-0 (the loaded one) its own half of the host's ``n`` cores and
    its ``decode - 1`` peers and the prefill worker the other half: the loaded worker then stands for
    a device of its own, which is what migration is for. Unpinned, every decode worker shares every
    core, and moving work to an idle one adds no compute. The prefill worker is not spread over both
    halves: its threads meet at a barrier every layer, so one busy core (decode-0's, or a peer's once
    migrations arrive) stalled every prefill step (a 19-prompt prefill took 0.85 s without migration
    and 1.6 s with it, this benchmark on a 2-core host). Nothing on a one-core host."""
    if n < 2:
        return []
    half = n // 2
    peers = ",".join(f"decode-{i}={_cpus(half, n - 1)}" for i in range(1, decode))
    return ["--worker-cpus", f"prefill-0={_cpus(half, n - 1)},decode-0={_cpus(0, half - 1)},{peers}"]


def arrival_gaps(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each of ``n`` requests: all 0 (one burst) for ``rate`` 0, else
    Poisson arrivals at ``rate`` per second, the same schedule for every run (seeded)."""
    if rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


def _serve_run(args, migrate: bool) -> dict:
    import openai

    from bench.harness.subprocess_server import LaunchedServer, metric_sum, wait_idle

    flags = [
        "--mode",
        "pd",
        "--decode",
        str(args.decode_workers),
        "--port",
        "0",
        "--route-decode",
        "decode-0",
        "--transfer-backend",
        args.backend,
        "--kv-pool-tokens",
        str(args.pool_tokens),
        "--page-size",
        "16",
        "--max-model-len",
        "2048",
        "--init-new-token-ratio",
        "0.05",
        "--health-interval-s",
        "0.5",
        "--log-level",
        "WARNING",
    ]
    if args.step_delay_s:
        flags += ["--test-step-delay-s", str(args.step_delay_s)]
    flags += (
        split_decode_cpus(os.cpu_count() or 1, args.decode_workers) if args.decode_cores == "split" else []
    ) + shlex.split(args.server_args)
    if migrate:
        flags += ["--migrate-after", args.migrate_after] + (["--migrate-on-retract"] if args.migrate_on_retract else [])
        flags += ["--migrate-queued"] if args.migrate_queued else []
    prompts = [SHARED + QUESTIONS[i % len(QUESTIONS)] + "." + " " * (i // len(QUESTIONS)) for i in range(args.requests)]
    # --long: the first N are long answers with longer prompts (retraction takes the shortest input
    # first among equals, so the short answers are the ones parked while the long ones hold the pool)
    head = long_prefix(args.long_prompt_words)
    prompts = [(head + p if i < args.long else p) for i, p in enumerate(prompts)]
    max_tokens = [args.long_max_tokens if i < args.long else args.max_tokens for i in range(args.requests)]
    with LaunchedServer(flags) as srv:
        model = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused").models.list().data[0].id

        async def run_all():
            c = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=1200)
            try:
                await _one(c, model, "Hello", 4)  # warm-up (first forward, first KV connection): not timed
                tasks = []
                for i, (p, n, delay) in enumerate(zip(prompts, max_tokens, arrival_gaps(len(prompts), args.rate))):
                    await asyncio.sleep(delay)
                    late = args.long_delay_s if i < args.long else args.short_delay_s
                    tasks.append(asyncio.create_task(_one(c, model, p, n, late)))
                return await asyncio.gather(*tasks)
            finally:
                await c.close()

        results = asyncio.run(run_all())
        m = wait_idle(srv.url, 0.5, timeout_s=120)
    return {
        "migrate": migrate,
        "retractions": metric_sum(m, "pdserve_retractions_total"),
        "migrations": metric_sum(m, "pdserve_migrations_total", direction="out", outcome="done"),
        "queued_moves": metric_sum(m, "pdserve_router_queued_moves_total"),
        **summarize(results, args.gap_factor),
    }


def summarize(results: list[dict], gap_factor: float) -> dict:
    """One run's requests (each with ``e2e``, ``gaps``, ``max_gap``, ``error``, ``ids``): failures, the
    retracted ones (longest gap over ``gap_factor`` x the median token gap of the run) and their
    quantiles, every request's P99 (all through ``percentile``), ids and a row per request."""
    median_gap = statistics.median([g for r in results for g in r["gaps"]] or [0.0])
    retracted = [r["max_gap"] > gap_factor * median_gap for r in results]
    lat = [r["e2e"] for r, parked in zip(results, retracted) if parked]
    return {
        "failed": sum(r["error"] is not None for r in results),
        "retracted_requests": len(lat),
        "p50_s": percentile(lat, 0.5),
        "p99_s": percentile(lat, 0.99),
        "stall_p99_s": percentile([r["max_gap"] for r, parked in zip(results, retracted) if parked], 0.99),
        "all_p99_s": percentile([r["e2e"] for r in results], 0.99),
        "ids": [r["ids"] for r in results],
        "requests": [
            {"e2e": round(r["e2e"], 2), "max_gap": round(r["max_gap"], 2), "retracted": parked}
            for r, parked in zip(results, retracted)
        ],
    }


def percentile(values, q: float) -> float | None:
    """The ``q`` quantile of ``values`` (the value at index ``int(q * n)``, the last at most), None if empty."""
    lat = sorted(values)
    return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None


def matched_p99_ratio(off: list[dict], on: list[dict]) -> float | None:
    """P99 e2e with migration over without, of the same requests: those retracted in the run without
    migration (``off[i]["retracted"]``; ``on[i]`` is request i in the run with it). Each run's own
    retracted set can differ (a request parked behind others without migration may never be parked
    with it, and the reverse), so the per-run ratio alone can compare different requests."""
    idx = [i for i, r in enumerate(off) if r["retracted"]]
    with_, without = percentile([on[i]["e2e"] for i in idx], 0.99), percentile([off[i]["e2e"] for i in idx], 0.99)
    return with_ / without if with_ and without else None


def serve_part(args) -> dict:
    off, on = _serve_run(args, False), _serve_run(args, True)
    same = off.pop("ids") == on.pop("ids")
    matched = matched_p99_ratio(off["requests"], on["requests"])
    if not args.per_request:
        off.pop("requests"), on.pop("requests")
    ratio = _ratio(on, off, "p99_s")
    return {
        "without": off,
        "with": on,
        "tokens_identical": same,
        "p99_ratio": ratio,
        "matched_p99_ratio": matched,
        "stall_p99_ratio": _ratio(on, off, "stall_p99_s"),
        "goal_met": serve_goal_met(ratio, matched, same, on["failed"] + off["failed"]),
    }


def _ratio(on: dict, off: dict, key: str) -> float | None:
    """``on[key] / off[key]`` (with migration over without), None when either is missing or 0."""
    return on[key] / off[key] if on[key] and off[key] else None


def serve_goal_met(ratio: float | None, matched: float | None, same_tokens: bool, failed: int) -> bool:
    """The issue's serve goal: both P99 ratios (per run, and matched) <= 0.5, identical tokens, no failure."""
    return ratio is not None and matched is not None and max(ratio, matched) <= 0.5 and same_tokens and failed == 0
