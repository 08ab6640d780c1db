"""Prometheus metrics of one router app (its own ``CollectorRegistry``; no global state).

Router series: ``pdserve_requests_total{status}`` (HTTP status of each generation request, 499
for a client that went away), ``pdserve_inflight_requests``, and the latency histograms
``pdserve_ttft_seconds``, ``pdserve_tpot_seconds``, ``pdserve_e2e_seconds`` (successful requests), and
``pdserve_router_retries_total`` (requests sent again on a fresh pair after a worker died before
their first token), ``pdserve_router_handbacks_total`` (requests a decode worker changing role handed
back before their first token, sent again without using a retry), ``pdserve_router_queued_moves_total``
(requests a decode worker offered while they waited for pages, sent to a peer decode worker before
their prefill: ``--migrate-queued``),
``pdserve_routing_decisions_total{reason}`` (cache-aware routing's picks; its
index series are in ``server.router.kv_metrics``).

Admission (``server.router.admission``): ``pdserve_shed_requests_total{reason}`` (requests never
forwarded: queue_full, queue_tokens, queue_wait, displaced -> 429; deadline -> 504; client_gone
while queued -> 499), ``pdserve_queue_wait_seconds`` (time each forwarded request spent in the
router's queue, 0 when it went at once), ``pdserve_queued_requests{key}`` and
``pdserve_queued_tokens{key}`` (the queue now, by API key name), and
``pdserve_router_outstanding_tokens{worker}`` (prompt + max_tokens of this router's requests in
flight on each worker: the work it has handed that worker and not seen finish), and
``pdserve_router_continuations{worker}`` (failed-over streams in flight that depend on each worker:
where a dead worker's streams wait to resume).

Worker series (label ``worker``) come from each worker's latest ``WorkerStats`` heartbeat via
``WorkerCollector``: counters are the worker's cumulative values, gauges its current values, so
they can lag by up to one heartbeat interval (``pdserve_worker_stats_age_seconds`` says by how much).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from engine.scheduler.stats import PHASE_BUCKETS
from server.router.registry import READY, WorkerHandle

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# worker counter key -> (metric name without _total, help)
WORKER_COUNTERS = {
    "prompt_tokens": ("pdserve_prompt_tokens", "Prompt tokens of requests accepted by the worker"),
    "generation_tokens": ("pdserve_generation_tokens", "Tokens generated (sampled) by the worker"),
    "retractions": ("pdserve_retractions", "Requests retracted under KV memory pressure"),
    "preemptions": (
        "pdserve_preemptions",
        "Running requests retracted to start a request of an API key under its "
        "share (PD decode workers, fair_preemption)",
    ),
    "retracted_input_tokens": ("pdserve_retracted_input_tokens", "Prompt tokens of retracted requests"),
    "retracted_output_tokens": ("pdserve_retracted_output_tokens", "Output tokens of retracted requests"),
    "oom_aborts": ("pdserve_oom_aborts", "Requests aborted because even alone they could not fit the KV pool"),
    "cached_prompt_tokens": ("pdserve_cached_prompt_tokens", "Prompt tokens served from the radix cache"),
    "finished_requests": ("pdserve_worker_finished_requests", "Requests the worker finished (stop or length)"),
    "aborted_requests": ("pdserve_worker_aborted_requests", "Requests the worker aborted on request"),
    "rejected_requests": ("pdserve_worker_rejected_requests", "Requests the worker refused at once"),
    "swa_rejections": ("pdserve_swa_rejections", "Requests refused because their SWA KV cannot fit the SWA pool"),
    "swa_pages_released": ("pdserve_swa_pages_released", "SWA pool pages freed because they left every window"),
    "kv_transfer_bytes": ("pdserve_kv_transfer_bytes", "KV bytes a prefill worker wrote into decode workers"),
    "direct_answers": (
        "pdserve_prefill_direct_answers",
        "One-token requests a prefill worker answered itself: no decode worker, no KV write",
    ),
    "transfer_failures": ("pdserve_transfer_failures", "KV transfers that failed or were rejected (manifest)"),
    "retract_offload_bytes": ("pdserve_retract_offload_bytes", "KV bytes copied to the host pool on retract"),
    "retract_resumed": ("pdserve_retract_resumed", "Retracted requests resumed from the host pool"),
    "retract_recomputed": ("pdserve_retract_recomputed", "Retracted requests re-prefilled (host pool full/costlier)"),
    "kv_events_published": (
        "pdserve_worker_kv_events_published",
        "KV event messages the worker published on its feed (cache-aware routing)",
    ),
    "kv_snapshots_published": (
        "pdserve_worker_kv_snapshots_published",
        "KV snapshots the worker published on its feed (a router asked to re-sync)",
    ),
    "refused_control_connections": (
        "pdserve_worker_refused_control_connections",
        "Control connection attempts the worker refused: the peer did not hold the cluster key (--cluster-key)",
    ),
    "mixed_steps": (
        "pdserve_worker_mixed_steps",
        "Forward steps that carried decode rows and a prefill chunk together (mixed batches)",
    ),
    "spec_draft_tokens": (
        "pdserve_spec_draft_tokens",
        "Draft tokens a worker verified (speculative decoding, --speculative-method)",
    ),
    "spec_accepted_tokens": (
        "pdserve_spec_accepted_tokens",
        "Draft tokens a worker verified and accepted: each is one token emitted without a step of its own",
    ),
    "migration_bytes": (
        "pdserve_migration_bytes",
        "KV bytes a decode worker wrote from its host pool into peer decode workers (retracted requests migrated)",
    ),
    "local_prefill_tokens": (
        "pdserve_local_prefill_tokens",
        "Prompt tokens a decode worker prefilled itself instead of a prefill worker (selective disaggregation)",
    ),
    "continuation_prefill_tokens": (
        "pdserve_continuation_prefill_tokens",
        "Prompt + output tokens a worker computed to prefill failover continuations (their radix hits not counted)",
    ),
    "continuation_cached_tokens": (
        "pdserve_continuation_cached_tokens",
        "Prompt + output tokens of failover continuations a worker's radix cache held when it admitted them",
    ),
    "borrowed_core_steps": (
        "pdserve_worker_borrowed_core_steps",
        "Steps a worker ran on every core of its host's launch while the other workers were idle (core lending)",
    ),
}
# worker histogram key -> (metric name, help)
WORKER_HISTOGRAMS = {
    "kv_transfer_seconds": ("pdserve_kv_transfer_seconds", "Prefill -> decode KV write time per request"),
    "retract_offload_seconds": ("pdserve_retract_offload_seconds", "Time to copy a retracted request's KV to host"),
    "retract_resume_seconds": ("pdserve_retract_resume_seconds", "Time to copy a retracted request's KV back"),
    "migration_seconds": (
        "pdserve_migration_seconds",
        "Host pool -> peer decode worker KV write time per migrated request (source side)",
    ),
    "spec_acceptance_length": (
        "pdserve_spec_acceptance_length",
        "Draft tokens accepted per verified row and step (speculative decoding, --speculative-method)",
    ),
}
# pdserve_migrations_total{worker,direction,outcome}: from the decode workers' migrations_<direction>_<outcome>
# pdserve_local_prefill_total{worker,reason}: the decode workers' local_prefill_<reason> (decode_worker.local_prefill)
MIGRATION_OUTCOMES = {"out": ("done", "failed", "declined"), "in": ("done", "failed", "refused")}
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _buckets(data) -> tuple[list[tuple[str, float]], float]:
    """(cumulative buckets, sum) of a worker's ``HistogramData`` for a ``HistogramMetricFamily``."""
    edges = [*(str(b) for b in data.buckets), "+Inf"]
    return list(zip(edges, itertools.accumulate(data.counts))), data.sum


class WorkerCollector(Collector):
    """Exposes the worker series from ``handles()`` (the registry's current handles)."""

    def __init__(self, handles: Callable[[], Iterable[WorkerHandle]], clock: Callable[[], float] = time.monotonic):
        self._handles = handles
        self._clock = clock

    def collect(self):
        """Yield one family per series; workers without stats yet only appear in ``pdserve_worker_up``."""
        handles = list(self._handles())
        up = GaugeMetricFamily("pdserve_worker_up", "1 if the worker is ready, else 0", labels=["worker", "role"])
        for h in handles:
            up.add_metric([h.worker_id, h.spec.role], 1.0 if h.state == READY else 0.0)
        yield up
        with_stats = [h for h in handles if h.stats is not None]
        yield from self._counters(with_stats)
        yield from self._gauges(with_stats)
        yield from self._histograms(with_stats)

    def _histograms(self, handles: list[WorkerHandle]):
        for key, (name, help_text) in WORKER_HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, help_text, labels=["worker"])
            for h in handles:
                if (data := h.stats.histograms.get(key)) is not None:
                    fam.add_metric([h.worker_id], *_buckets(data))
            yield fam
        phases = HistogramMetricFamily(
            "pdserve_request_phase_seconds",
            "Per-request time in each phase on a "
            "worker (queue, prefill compute, bootstrap wait, transfer, decode, ...)",
            labels=["worker", "phase"],
        )
        for h in handles:
            for key, data in sorted(h.stats.histograms.items()):
                if key.startswith("phase_"):
                    phases.add_metric([h.worker_id, key.removeprefix("phase_")], *_buckets(data))
        yield phases

    def _counters(self, handles: list[WorkerHandle]):
        for key, (name, help_text) in WORKER_COUNTERS.items():
            fam = CounterMetricFamily(name, help_text, labels=["worker"])
            for h in handles:
                fam.add_metric([h.worker_id], h.stats.counters.get(key, 0.0))
            yield fam
        moves = CounterMetricFamily(
            "pdserve_migrations",
            "Retracted requests moved between decode workers: out (this "
            "worker was the source: done, failed, declined by the router) and in (the "
            "target: done, failed, refused)",
            labels=["worker", "direction", "outcome"],
        )
        for h in handles:
            for direction, outcomes in MIGRATION_OUTCOMES.items():
                for outcome in outcomes:
                    if (v := h.stats.counters.get(f"migrations_{direction}_{outcome}")) is not None:
                        moves.add_metric([h.worker_id, direction, outcome], v)
        yield moves
        local = CounterMetricFamily(
            "pdserve_local_prefill",
            "Selective disaggregation decisions of the decode "
            "workers: taken (prefilled by the decode worker) or why the request went to a "
            "prefill worker",
            labels=["worker", "reason"],
        )
        for h in handles:
            for key, v in sorted(h.stats.counters.items()):
                if key.startswith("local_prefill_") and key != "local_prefill_tokens":
                    local.add_metric([h.worker_id, key.removeprefix("local_prefill_")], v)
        yield local

    def _gauges(self, handles: list[WorkerHandle]):
        pages = GaugeMetricFamily("pdserve_kv_pool_pages", "KV pool pages by state", labels=["worker", "state"])
        total = GaugeMetricFamily("pdserve_kv_pool_capacity_pages", "KV pool size in pages", labels=["worker"])
        queues = GaugeMetricFamily("pdserve_queue_requests", "Requests per scheduler queue", labels=["worker", "queue"])
        ratio = GaugeMetricFamily("pdserve_new_token_ratio", "Admission reservation ratio", labels=["worker"])
        swa = GaugeMetricFamily(
            "pdserve_swa_pool_pages", "Sliding-window (SWA) KV pool pages by state", labels=["worker", "state"]
        )
        swa_total = GaugeMetricFamily("pdserve_swa_pool_capacity_pages", "SWA KV pool size in pages", labels=["worker"])
        host = GaugeMetricFamily(
            "pdserve_host_kv_pool_bytes", "Host (CPU) KV pool for retracted requests", labels=["worker", "state"]
        )
        age = GaugeMetricFamily("pdserve_worker_stats_age_seconds", "Age of the latest worker stats", labels=["worker"])
        sources = GaugeMetricFamily(
            "pdserve_kv_sources",
            "A PD decode worker's KV sources (its prefill workers and, "
            "with migration, its decode peers) by handshake state",
            labels=["worker", "state"],
        )
        threads = GaugeMetricFamily(
            "pdserve_worker_torch_threads",
            "Torch threads of the worker's latest step (workers with core lending only)",
            labels=["worker"],
        )
        for h in handles:
            g, w = h.stats.gauges, h.worker_id
            for state in ("free", "used", "cached"):
                pages.add_metric([w, state], g.get(f"kv_pages_{state}", 0.0))
            total.add_metric([w], g.get("kv_pages_total", 0.0))
            if "swa_pages_total" in g:
                for state in ("free", "used", "cached"):
                    swa.add_metric([w, state], g[f"swa_pages_{state}"])
                swa_total.add_metric([w], g["swa_pages_total"])
            for q in (k.removeprefix("queue_") for k in g if k.startswith("queue_")):
                queues.add_metric([w, q], g[f"queue_{q}"])
            if "host_kv_pool_bytes_used" in g:
                for state in ("used", "free"):
                    host.add_metric([w, state], g[f"host_kv_pool_bytes_{state}"])
            ratio.add_metric([w], g.get("new_token_ratio", 0.0))
            age.add_metric([w], max(0.0, self._clock() - h.stats_at) if h.stats_at is not None else 0.0)
            for state in (k.removeprefix("kv_sources_") for k in g if k.startswith("kv_sources_")):
                sources.add_metric([w, state], g[f"kv_sources_{state}"])
            if "torch_threads" in g:
                threads.add_metric([w], g["torch_threads"])
        yield from (pages, total, swa, swa_total, queues, ratio, host, age, sources, threads)


class AdmissionCollector(Collector):
    """The admission queue's gauges by key, the router's outstanding tokens and continuations by worker."""

    def __init__(
        self,
        queued: Callable[[], dict[str, tuple[int, int]]],
        handles: Callable[[], Iterable[WorkerHandle]],
        outstanding: Callable[[str], int],
        continuations: Callable[[str], int],
    ) -> None:
        self._queued, self._handles, self._outstanding = queued, handles, outstanding
        self._continuations = continuations

    def collect(self):
        """Yield ``pdserve_queued_requests``, ``pdserve_queued_tokens``, ``pdserve_router_outstanding_tokens``
        and ``pdserve_router_continuations``."""
        reqs = GaugeMetricFamily(
            "pdserve_queued_requests", "Requests waiting in the router's admission queue", labels=["key"]
        )
        toks = GaugeMetricFamily(
            "pdserve_queued_tokens",
            "Prompt + max_tokens of the requests in the router's admission queue",
            labels=["key"],
        )
        for key, (n, t) in sorted(self._queued().items()):
            reqs.add_metric([key], n)
            toks.add_metric([key], t)
        out = GaugeMetricFamily(
            "pdserve_router_outstanding_tokens",
            "Prompt + max_tokens of this router's requests in flight on each worker",
            labels=["worker"],
        )
        cont = GaugeMetricFamily(
            "pdserve_router_continuations",
            "Failed-over streams of this router in flight that depend on each worker: their decode worker, "
            "and their prefill worker until their first new token",
            labels=["worker"],
        )
        for h in self._handles():
            out.add_metric([h.worker_id], self._outstanding(h.worker_id))
            cont.add_metric([h.worker_id], self._continuations(h.worker_id))
        yield from (reqs, toks, out, cont)


class RouterMetrics:
    """The router's metrics; ``render()`` returns the Prometheus text exposition."""

    def __init__(
        self,
        handles: Callable[[], Iterable[WorkerHandle]],
        inflight: Callable[[], int],
        queued: Callable[[], dict[str, tuple[int, int]]] = dict,
        outstanding: Callable[[str], int] = lambda _: 0,
        continuations: Callable[[str], int] = lambda _: 0,
    ) -> None:
        """``handles``: current worker handles; ``inflight``: number of requests in flight;
        ``queued``: admission queue by key, (requests, tokens); ``outstanding``: in-flight tokens of a
        worker; ``continuations``: failed-over streams in flight that depend on a worker."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Generation requests by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "pdserve_tpot_seconds", "Time per output token after the first", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds", "Request latency, arrival to last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.router_queue = Histogram(
            "pdserve_router_queue_seconds",
            "Arrival to the request going out to workers (parse, tokenize, route)",
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdserve_router_retries",
            "Requests sent again on another worker pair because a "
            "worker of theirs died before their first token (fresh_pair_retries)",
            registry=r,
        )
        self.handbacks = Counter(
            "pdserve_router_handbacks",
            "Requests sent again on another worker pair because their decode worker, changing role, "
            "handed them back before their first token (no fresh_pair_retries retry used)",
            registry=r,
        )
        self.failovers = Counter(
            "pdserve_failovers",
            "Failovers of requests whose streaming worker died after tokens were streamed, by the "
            "worker that was streaming and outcome (continued, limit, no_route, unfit, unreachable)",
            ["worker", "outcome"],
            registry=r,
        )
        self.failover_recomputed = Counter(
            "pdserve_failover_recomputed_tokens",
            "Output tokens computed again by the live route of a continuation (max_failovers)",
            registry=r,
        )
        self.failover_same_prefill = Counter(
            "pdserve_failover_same_prefill",
            "Continuations sent to the prefill worker of their failed route, whose radix cache holds their prompt (PD)",
            registry=r,
        )
        self.failover_stall = Histogram(
            "pdserve_failover_stall_seconds",
            "The gap a client saw across a failover: its last token from the dead worker to its "
            "first from the continuation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queued_moves = Counter(
            "pdserve_router_queued_moves",
            "Requests sent to another decode worker before "
            "their prefill because theirs offered them while they waited for pages "
            "(migrate_queued)",
            registry=r,
        )
        Gauge("pdserve_inflight_requests", "Requests in the router's in-flight table", registry=r).set_function(
            inflight
        )
        self.queued = queued
        self.shed = Counter(
            "pdserve_shed_requests",
            "Requests the router's admission stage never forwarded, by reason",
            ["reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds",
            "Time forwarded requests waited in the router's admission queue",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.routing = Counter(
            "pdserve_routing_decisions",
            "Cache-aware routing picks by reason: local (the decode "
            "worker is expected to prefill the uncached suffix itself), prefix (a chosen worker "
            "holds part of the prompt), load (none does), cap (the cheapest worker was over "
            "routing_balance_slack)",
            ["reason"],
            registry=r,
        )
        self.role_switches = Counter(
            "pdserve_role_switches",
            "Workers that changed role at runtime, by old role, new role and reason (admin: POST /admin/role; "
            "planner: --planner slo)",
            ["from", "to", "reason"],
            registry=r,
        )
        r.register(WorkerCollector(handles))
        r.register(AdmissionCollector(queued, handles, outstanding, continuations))

    def observe_shed(self, reason: str) -> None:
        """Count one request the admission stage did not forward (``reason``: a ``Refused.reason`` or client_gone)."""
        self.shed.labels(reason=reason).inc()

    def observe_routing(self, reason: str) -> None:
        """Count one cache-aware routing decision (``reason``: local, prefix, load or cap)."""
        self.routing.labels(reason=reason).inc()

    def observe_role_switch(self, old: str, new: str, reason: str) -> None:
        """Count one completed role switch of a worker from role ``old`` to ``new``."""
        self.role_switches.labels(**{"from": old, "to": new, "reason": reason}).inc()

    def observe_request(self, status: int) -> None:
        """Count one generation request that ended with HTTP ``status``."""
        self.requests.labels(status=str(status)).inc()

    def observe_latency(self, ttft: float | None, tpot: float | None, e2e: float, queue: float | None = None) -> None:
        """Record a successful request's latencies (seconds; None = not applicable)."""
        for hist, value in ((self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e), (self.router_queue, queue)):
            if value is not None:
                hist.observe(value)

    def render(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)
