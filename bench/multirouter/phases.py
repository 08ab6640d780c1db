"""The phases of ``bench.two_routers``: one closed-loop load against one router (A) or split
round-robin over several (B), with the workers' counters read before and after.

Every phase sends the same prompts (one ``make_requests`` draw) behind a tag of its own at the
start (``"7: ..."``): the workloads are equal but no prompt's first page is in any radix cache
from an earlier phase, so no phase is served from another's cache.

Counters come from a router's ``/metrics`` (the workers' cumulative counters as of their latest
heartbeat), scraped fresh (every worker series newer than the scrape's start) once the phase's
last stream closed: the delta of ``pdserve_worker_finished_requests_total`` and
``pdserve_generation_tokens_total`` per worker is what each worker did in the phase; the delta of
each router's ``pdserve_requests_total{status="200"}`` is what each router served. CPU seconds of
every router and worker process (``/proc/PID/stat``, as ``bench serve`` reads them) over the load
say what a phase cost whatever else the host ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from dataclasses import dataclass, field

from bench.harness.subprocess_server import fresh_metrics, metric_sum, scrape_metrics
from bench.serve.client import ClientConfig, RequestResult
from bench.serve.cpu import cpu_seconds
from bench.serve.runner import closed_loop
from bench.serve.stats import RunStats, compute_stats
from bench.serve.workload import LengthCounter, RequestSpec

WORKER_COUNTERS = {"finished": "pdserve_worker_finished_requests_total", "tokens": "pdserve_generation_tokens_total"}


def tagged(specs: list[RequestSpec], tag: int, counter: LengthCounter) -> list[RequestSpec]:
    """``specs`` with ``"{tag}: "`` in front of every prompt (lengths recounted)."""
    out = []
    for s in specs:
        prompt = f"{tag}: {s.prompt}"
        out.append(dataclasses.replace(s, prompt=prompt, prompt_len=counter.count(prompt)))
    return out


def spread(values: list[float]) -> float | None:
    """(max - min) / mean of ``values``; None when there are fewer than two or the mean is 0."""
    if len(values) < 2 or sum(values) <= 0:
        return None
    return (max(values) - min(values)) / (sum(values) / len(values))


@dataclass
class WorkerSplit:
    """What each worker of the measured role did in one phase (counter deltas) and each router served."""

    finished: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    router_ok: dict[str, float] = field(default_factory=dict)

    @property
    def finished_spread(self) -> float | None:
        return spread(list(self.finished.values()))

    @property
    def tokens_spread(self) -> float | None:
        return spread(list(self.tokens.values()))

    def plus(self, other: WorkerSplit) -> WorkerSplit:
        """The sum of two phases' splits, key by key."""

        def add(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in sorted({*a, *b})}

        return WorkerSplit(
            add(self.finished, other.finished), add(self.tokens, other.tokens), add(self.router_ok, other.router_ok)
        )

    def to_dict(self) -> dict:
        return {
            "finished": self.finished,
            "tokens": self.tokens,
            "router_ok": self.router_ok,
            "finished_spread": self.finished_spread,
            "tokens_spread": self.tokens_spread,
        }


@dataclass
class Snapshot:
    """The counters of one moment: per worker (from one router's view) and per router."""

    workers: dict[str, dict[str, float]]
    router_ok: dict[str, float]


def snapshot(urls: list[str], worker_ids: list[str], heartbeat_s: float) -> Snapshot:
    """Fresh worker counters from the first router, and every router's successful requests."""
    m = fresh_metrics(urls[0], heartbeat_s, timeout_s=max(15.0, 10 * heartbeat_s))
    workers = {key: {w: metric_sum(m, name, worker=w) for w in worker_ids} for key, name in WORKER_COUNTERS.items()}
    ok = {
        url: metric_sum(m if url == urls[0] else scrape_metrics(url), "pdserve_requests_total", status="200")
        for url in urls
    }
    return Snapshot(workers, ok)


def split_between(before: Snapshot, after: Snapshot) -> WorkerSplit:
    """The counter deltas from ``before`` to ``after``."""
    d = {
        key: {w: after.workers[key][w] - before.workers[key].get(w, 0.0) for w in after.workers[key]}
        for key in WORKER_COUNTERS
    }
    return WorkerSplit(
        d["finished"], d["tokens"], {u: v - before.router_ok.get(u, 0.0) for u, v in after.router_ok.items()}
    )


@dataclass
class PhaseResult:
    """One phase: its name (``A1``, ``B1``, ...), the routers it loaded, its statistics and split."""

    name: str
    routers: list[str]
    stats: RunStats
    split: WorkerSplit
    failures: list[RequestResult]
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process over the load

    @property
    def kind(self) -> str:
        return self.name[0]

    def cpu_ms_per_token(self, prefix: str | tuple[str, ...]) -> float | None:
        """CPU ms per output token of the processes whose name starts with ``prefix`` (together)."""
        spent = [v for k, v in self.cpu_s.items() if k.startswith(prefix)]
        return 1000 * sum(spent) / self.stats.output_tokens if spent and self.stats.output_tokens else None

    def to_dict(self) -> dict:
        return {
            "phase": self.name,
            "routers": self.routers,
            "stats": self.stats.to_dict(),
            "split": self.split.to_dict(),
            "cpu_s": self.cpu_s,
            "failures": [{"index": r.index, "error": r.error} for r in self.failures],
        }


def failed(results: list[RequestResult]) -> list[RequestResult]:
    """Requests that failed, or came back with another number of tokens than asked (ignore_eos)."""
    out = []
    for r in results:
        if r.ok and r.output_tokens != r.expected_output_len:
            r = dataclasses.replace(r, ok=False, error=f"{r.output_tokens} tokens, asked {r.expected_output_len}")
        if not r.ok:
            out.append(r)
    return out


def cpu_between(before: dict[str, float | None], pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process of ``pids`` used since ``before`` (its CPU seconds then)."""
    out = {}
    for name, pid in pids.items():
        now = cpu_seconds(pid)
        if now is not None and before.get(name) is not None:
            out[name] = now - before[name]
    return out


def run_phase(
    name: str,
    cfg: ClientConfig,
    specs: list[RequestSpec],
    concurrency: int,
    all_urls: list[str],
    worker_ids: list[str],
    heartbeat_s: float,
    progress: bool,
    pids: dict[str, int],
) -> PhaseResult:
    """Load ``cfg``'s router(s) with ``specs`` at ``concurrency``; read the counters around it and the
    CPU seconds of every process of ``pids`` (name -> pid) over the load itself."""
    before = snapshot(all_urls, worker_ids, heartbeat_s)
    cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
    m = asyncio.run(closed_loop(cfg, specs, concurrency, progress=progress))
    cpu = cpu_between(cpu0, pids)
    after = snapshot(all_urls, worker_ids, heartbeat_s)
    routers = list(cfg.base_urls) or [cfg.base_url]
    return PhaseResult(
        name, routers, compute_stats(m.results, m.duration_s), split_between(before, after), failed(m.results), cpu
    )


def median_of(phases: list[PhaseResult], value) -> float | None:
    """The median of ``value(phase)`` over ``phases`` (None values left out; None if none is left)."""
    xs = [v for v in (value(p) for p in phases) if v is not None]
    return statistics.median(xs) if xs else None
