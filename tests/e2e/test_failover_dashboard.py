"""The dashboard shows a failover: two colocated replicas (``pdserve launch --replicas 2``), the
dashboard open in headless Chromium, a streamed greedy completion and ``kill -9`` of the replica
serving it mid-stream. The page draws one "continued" failover marker on the requests panel's
charts and its failover tiles (by worker and outcome, recomputed tokens, stall count and
percentiles) equal ``/metrics``; no JavaScript error is logged."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import pytest

from bench.harness.subprocess_server import fresh_metrics, metric_sum, scrape_metrics
from benchmarks.failover_load import stream, worker_pid
from tests.router.dashboard_dom import dom_values, histogram_quantile
from tests.support.chromium_cdp import Browser, find_chromium

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
KILL_AFTER = 8
WORKERS = ("colocated-0", "colocated-1")
BODY = {
    "prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "max_tokens": 48,
    "ignore_eos": True,
    "temperature": 0,
}
CHROMIUM = find_chromium()
# the counts on the requests panel's failover markers (labels "↻N") of its first chart
MARKED = """(() => { const svg = document.querySelector('#requests svg');
  return svg ? [...svg.querySelectorAll('g.marker.failover.continued text')]
    .reduce((a, t) => a + Number(t.textContent.slice(1)), 0) : 0; })()"""
FAILOVER_SERIES = ("pdserve_failover",)


def browser():
    """A headless Chromium, or None without one unless CI requires it (PDSERVE_REQUIRE_CHROMIUM=1)."""
    if not CHROMIUM:
        assert os.environ.get("PDSERVE_REQUIRE_CHROMIUM") != "1", "chromium is not installed"
        return contextlib.nullcontext()
    return Browser(CHROMIUM)


def serving_worker(url: str, before: dict) -> str:
    """The replica whose generated-token counter moved since ``before``."""
    m = fresh_metrics(url, HEARTBEAT_S)
    name = "pdserve_generation_tokens_total"
    moved = [w for w in WORKERS if metric_sum(m, name, worker=w) > metric_sum(before, name, worker=w)]
    assert len(moved) == 1, moved
    return moved[0]


def failover_mismatches(page, m: dict) -> list[str]:
    """The page's failover numbers that differ from the /metrics samples ``m`` (or miss there)."""
    samples, quantiles = dom_values(page)
    bad = []
    for name, labels, value in samples:
        if name.startswith(FAILOVER_SERIES):
            want = m.get((name, tuple(sorted(json.loads(labels).items()))))
            if want is None or float(value) != want:
                bad.append(f"{name}{labels}: page {value} != /metrics {want}")
    for hist, q, labels, value in quantiles:
        if hist.startswith(FAILOVER_SERIES):
            want = histogram_quantile(float(q), m, hist, json.loads(labels))
            if want is None or abs(float(value) - want) > 1e-6 * max(1.0, want):
                bad.append(f"P{float(q) * 100:g} of {hist}: page {value} != /metrics {want}")
    return bad


def test_a_failover_is_marked_on_the_dashboard(launched_server):
    server = launched_server(
        "colocated",
        "--replicas",
        "2",
        "--kv-pool-tokens",
        "2048",
        "--page-size",
        "16",
        "--health-interval-s",
        str(HEARTBEAT_S),
    )
    with browser() as b:
        if b is None:
            pytest.skip("chromium is not installed")
        page = b.open()
        page.navigate(f"{server.url}/dashboard")
        page.wait_for("document.querySelectorAll('#requests-tiles .tile').length > 0", 30)
        before = fresh_metrics(server.url, HEARTBEAT_S)
        reached, killed = threading.Event(), {}

        def killer() -> None:
            reached.wait(120)
            killed["worker"] = serving_worker(server.url, before)
            os.kill(worker_pid(server, killed["worker"]), signal.SIGKILL)

        t = threading.Thread(target=killer)
        t.start()
        got = stream(server.url, BODY, lambda out: out["tokens"] >= KILL_AFTER and reached.set())
        t.join()
        assert got["errors"] == [] and got["usage"]["completion_tokens"] == BODY["max_tokens"]
        m = scrape_metrics(server.url)
        assert metric_sum(m, "pdserve_failovers_total", worker=killed["worker"], outcome="continued") == 1
        page.wait_for(f"{MARKED} === 1", 15)
        # the page may still show a snapshot from mid-stream (failover counted, stall not yet): wait for both
        tile = json.dumps({"outcome": "continued", "worker": killed["worker"]}, separators=(",", ":"))
        for metric, labels, value in (
            ("pdserve_failovers_total", tile, 1),
            ("pdserve_failover_stall_seconds_count", "{}", 1),
            (
                "pdserve_failover_recomputed_tokens_total",
                "{}",
                int(metric_sum(m, "pdserve_failover_recomputed_tokens_total")),
            ),
        ):
            page.wait_for(
                f"[...document.querySelectorAll('[data-metric={metric}]')]"
                f".some((e) => e.dataset.labels === '{labels}' && e.dataset.value === '{value}')",
                15,
            )
        assert failover_mismatches(page, scrape_metrics(server.url)) == []
        assert page.errors() == []
