"""Load schedules: closed loop (N clients, each sends its next request when the last one ends) and
open loop (requests sent at their ``arrival_s`` whatever is in flight). Both return every result
(failures included) and the wall duration of the measured part; warm-up requests are not counted.
A ``meter`` (anything with ``start()`` and ``stop()``, e.g. ``cpu.CpuMeter``) is started right
before the first measured request and stopped right after the last one ends.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
from tqdm import tqdm

from bench.serve.client import ClientConfig, RequestResult, send
from bench.serve.workload import RequestSpec


@dataclass
class Measured:
    """Results of one run and its wall duration (first send -> last stream closed)."""

    results: list[RequestResult]
    duration_s: float


class Meter(Protocol):
    """Something measured over exactly the measured part of a run."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class _NoMeter:
    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _http_client(parallel: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(parallel, 1) + 4, max_keepalive_connections=max(parallel, 1) + 4)
    return httpx.AsyncClient(limits=limits, trust_env=False, timeout=None)


def _bar(total: int, label: str, show: bool) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=not show, leave=False)


async def _warm_up(client: httpx.AsyncClient, cfg: ClientConfig, warmup: list[RequestSpec], parallel: int) -> None:
    """Send the warm-up requests ``parallel`` at a time; a failed warm-up aborts the run with its error."""
    for i in range(0, len(warmup), max(parallel, 1)):
        done = await asyncio.gather(*(send(client, cfg, s) for s in warmup[i : i + parallel]))
        bad = [r.error for r in done if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up request failed against {cfg.base_url}: {bad[0]}")


async def closed_loop(
    cfg: ClientConfig,
    specs: list[RequestSpec],
    concurrency: int,
    warmup: list[RequestSpec] = (),
    progress: bool = True,
    meter: Meter | None = None,
) -> Measured:
    """Run ``specs`` with ``concurrency`` clients pulling from one queue (in order)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    async with _http_client(concurrency) as client:
        await _warm_up(client, cfg, list(warmup), concurrency)
        queue: asyncio.Queue = asyncio.Queue()
        for s in specs:
            queue.put_nowait(s)
        results: list[RequestResult] = []
        bar = _bar(len(specs), f"c={concurrency}", progress)

        async def worker() -> None:
            while not queue.empty():
                results.append(await send(client, cfg, queue.get_nowait()))
                bar.update(1)

        meter = meter or _NoMeter()
        meter.start()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
        duration = time.perf_counter() - t0
        meter.stop()
        bar.close()
    return Measured(sorted(results, key=lambda r: r.index), duration)


async def open_loop(
    cfg: ClientConfig,
    specs: list[RequestSpec],
    warmup: list[RequestSpec] = (),
    progress: bool = True,
    label: str = "open loop",
    meter: Meter | None = None,
) -> Measured:
    """Send each spec at its ``arrival_s`` (seconds after the start), not waiting for earlier ones."""
    if any(s.arrival_s is None for s in specs):
        raise ValueError("open loop needs an arrival_s on every request (see workload.poisson_arrivals)")
    async with _http_client(len(specs)) as client:
        await _warm_up(client, cfg, list(warmup), 2)
        bar = _bar(len(specs), label, progress)
        meter = meter or _NoMeter()
        meter.start()
        t0 = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
            r = await send(client, cfg, spec)
            bar.update(1)
            return r

        results = await asyncio.gather(*(one(s) for s in specs))
        duration = time.perf_counter() - t0
        meter.stop()
        bar.close()
    return Measured(list(results), duration)
