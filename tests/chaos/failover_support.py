"""What every failover chaos row shares: the mixed streamed load (greedy, seeded temperature,
``json_schema``, ``n=2``, ``logprobs``, stop strings) of ``STREAMS`` requests of ``MAX_TOKENS``
tokens, its fault-free reference run, the load with a signal sent at a seeded moment, and the end
checks of a row (``assert_failed_over``): no request failed, every output equal to the reference
(text, token ids, finish reason, logprobs, usage), each named worker's streams continued, no
failover ended otherwise, and no KV page, host pool byte or in-flight entry left on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.harness.subprocess_server import metric_sum
from benchmarks.failover_load import astream, differences, first_difference, mixed_bodies, same_output
from tests.chaos.chaos_cluster import Cluster, leaks, running, signal_worker
from tests.chaos.tiny_model import save_tiny_model

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))
STREAMS, MAX_TOKENS = 12, 48
PAGE_SIZE = 16
WORDS = "river stone light garden window morning paper music silver forest engine voice winter harbor".split()
ARGS = [
    "--kv-pool-tokens",
    "2048",
    "--page-size",
    str(PAGE_SIZE),
    "--max-model-len",
    "512",
    "--test-step-delay-s",
    "0.02",
]


@contextlib.contextmanager
def failover_cluster(model_dir: Path, prefill: int, decode: int) -> Iterator[Cluster]:
    """A started cluster of ``prefill`` + ``decode`` workers on the tiny model (saved to ``model_dir``)
    with ``ARGS`` and a 30 s heartbeat lease (``--worker-timeout-s``), so that only a row's kills are
    deaths, not a stopped or slow worker; stopped when the block ends."""
    args = [*ARGS, "--worker-timeout-s", "30"]
    yield from running(Cluster(save_tiny_model(model_dir), prefill=prefill, decode=decode, args=args))


async def load(url: str, bodies: list[dict], on_chunk=None) -> list[dict]:
    """Every body streamed at once, one connection each; the records in the bodies' order."""
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as c:
        return await asyncio.gather(*(astream(c, b, on_chunk) for b in bodies))


def tokens_reached(kill_tokens: int) -> tuple[Callable[[dict], None], asyncio.Event]:
    """(an ``on_chunk`` for ``load``, an event set once the clients hold ``kill_tokens`` tokens)."""
    held: dict[int, int] = {}
    reached = asyncio.Event()

    def counting(out: dict) -> None:
        held[id(out)] = out["tokens"]
        if sum(held.values()) >= kill_tokens:
            reached.set()

    return counting, reached


async def killed_load(
    cluster,
    bodies: list[dict],
    kill_tokens: int,
    workers: tuple[str, ...] = ("decode-0", "decode-1"),
    signal_with=signal_worker,
) -> tuple[list[dict], str]:
    """The load with ``kill -9`` (``signal_with(cluster, worker, SIGKILL)``) of the one of ``workers``
    running the most requests once the clients hold ``kill_tokens`` tokens; (records, victim).
    ``cluster``: anything with ``url`` and ``metrics()``."""
    counting, reached = tokens_reached(kill_tokens)
    task = asyncio.create_task(load(cluster.url, bodies, counting))
    await reached.wait()
    victim = (await asyncio.to_thread(busiest_first, cluster, workers))[0]
    signal_with(cluster, victim, signal.SIGKILL)
    return await task, victim


def outstanding(cluster, worker: str) -> float:
    """Prompt + max_tokens of the router's requests in flight on ``worker`` (its own table, live)."""
    return metric_sum(cluster.metrics(), "pdserve_router_outstanding_tokens", worker=worker)


def continuations(cluster, worker: str) -> float:
    """The router's failed-over streams in flight that depend on ``worker`` (its own table, live)."""
    return metric_sum(cluster.metrics(), "pdserve_router_continuations", worker=worker)


def busiest_first(cluster, workers: tuple[str, ...]) -> list[str]:
    """``workers`` by the requests each runs, most first (the router's view of their heartbeats)."""
    m = cluster.metrics()
    return sorted(workers, key=lambda w: -metric_sum(m, "pdserve_queue_requests", worker=w, queue="running"))


async def requests_left(cluster, worker: str, settle_s: float = 0.3, timeout_s: float = 10.0) -> None:
    """Wait until the router holds nothing in flight on ``worker`` (dead: its requests failed and
    their continuations went out), then ``settle_s`` for the new routes to take them."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(outstanding, cluster, worker) > 0:
        assert time.monotonic() < deadline, f"{worker}'s requests never left it"
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)


@dataclass
class Reference:
    """The mixed load's bodies, its fault-free outputs and the metrics once the cluster was idle."""

    mixes: list[tuple[str, dict]]
    outputs: list[dict]
    before: dict

    @property
    def bodies(self) -> list[dict]:
        return [b for _, b in self.mixes]

    def kill_tokens(self, salt: int, low: float = 0.15, high: float = 0.5) -> tuple[int, int]:
        """(the seeded moment: a share in [low, high) of all tokens, all tokens) for the row ``salt``."""
        total = sum(b.get("n", 1) for b in self.bodies) * MAX_TOKENS
        return int(random.Random(SEED + salt).uniform(low, high) * total), total


def fault_free(url: str, recovered: Callable[[], dict]) -> Reference:
    """Run the seeded mixed load without a fault (every request must end without error), then
    ``recovered()`` (fresh metrics once the cluster is idle)."""
    mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
    outputs = asyncio.run(load(url, [b for _, b in mixes]))
    assert [r["errors"] for r in outputs] == [[]] * STREAMS
    return Reference(mixes, outputs, recovered())


def assert_failed_over(
    row: str, ref: Reference, got: list[dict], after: dict, continued_from: tuple[str, ...] = ()
) -> Callable[..., float]:
    """The end checks of a row (see the module docstring; ``after``: the metrics once the cluster
    recovered): the failovers of each of ``continued_from`` were continued, and every failover
    was. Prints one line for the row; returns ``moved(name, **labels)``, a counter's change over
    the faulted run, for the row's own checks."""

    def moved(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(ref.before, name, **labels)

    bad = [
        (n, first_difference(g, r), differences(g, r))
        for (n, _), g, r in zip(ref.mixes, got, ref.outputs)
        if not same_output(g, r)
    ]
    counts = {w: moved("pdserve_failovers_total", worker=w, outcome="continued") for w in continued_from}
    print(
        f"\n{row} (seed {SEED}): continued {counts or 0}, "
        f"{moved('pdserve_failover_recomputed_tokens_total'):g} tokens recomputed, "
        f"{moved('pdserve_router_retries_total'):g} retried, leaks {leaks(after)}, differing {bad}"
    )
    assert [g["errors"] for g in got] == [[]] * STREAMS
    assert bad == []
    assert all(n >= 1 for n in counts.values()), counts
    assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", outcome="continued")
    assert leaks(after) == (0, 0)
    assert metric_sum(after, "pdserve_inflight_requests") == 0
    return moved
