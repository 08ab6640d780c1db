"""Prometheus series of cache-aware routing's index and feeds (``--routing cache-aware`` only).

``pdserve_router_kv_index_pages{worker}``: page hashes the router's index holds per worker;
``pdserve_router_kv_index_synced{worker}``: 1 while the index is in sync with the worker's feed;
``pdserve_router_kv_events_total``: ``KvEvents`` messages applied; ``pdserve_router_kv_snapshots_total``:
``KvSnapshot`` messages applied; ``pdserve_router_kv_resyncs_total{cause}``: snapshot requests the
router sent (initial, gap, restart). Decisions by reason are ``pdserve_routing_decisions_total``
(``server.router.metrics``).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from server.router.kv_subscriber import KvSubscriber


class KvIndexCollector(Collector):
    """Reads ``subscriber`` (and its index) at every scrape."""

    def __init__(self, subscriber: KvSubscriber) -> None:
        self._sub = subscriber

    def collect(self):
        """Yield the series in the module docstring."""
        index = self._sub.index
        pages = GaugeMetricFamily(
            "pdserve_router_kv_index_pages",
            "Page hashes the router's cache index holds per worker (cache-aware routing)",
            labels=["worker"],
        )
        synced = GaugeMetricFamily(
            "pdserve_router_kv_index_synced",
            "1 while the router's cache index is in sync with the worker's KV event feed",
            labels=["worker"],
        )
        for wid in sorted(index.workers):
            pages.add_metric([wid], index.size(wid))
            synced.add_metric([wid], 0.0 if index.needs_snapshot(wid) else 1.0)
        events = CounterMetricFamily("pdserve_router_kv_events", "KV event messages the router's cache index applied")
        events.add_metric([], index.counters.events)
        snaps = CounterMetricFamily("pdserve_router_kv_snapshots", "KV snapshots the router's cache index applied")
        snaps.add_metric([], index.counters.snapshots)
        resyncs = CounterMetricFamily(
            "pdserve_router_kv_resyncs", "KV snapshot requests the router sent, by cause", labels=["cause"]
        )
        for cause, n in sorted(self._sub.resyncs.items()):
            resyncs.add_metric([cause], n)
        yield from (pages, synced, events, snaps, resyncs)
