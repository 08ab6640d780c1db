"""Unit: every series the dashboard page names is one the router exports on ``/metrics``, and the
migration panel reads the worker counters the decode worker reports.

The page (``server/router/static/dashboard.js``) tags each number with the ``/metrics`` sample it
shows (``data-metric``/``data-hist``); a renamed or dropped series would leave a tile that the
browser test (tests/router/test_dashboard.py) only catches on a launched server. Here the names are read
out of the script and checked against what the router renders for a decode and a prefill worker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from configs.schema import PdserveConfig
from server.router.app import build_context
from server.router.dashboard import ASSETS, snapshot
from server.router.failover import OUTCOMES as FAILOVER_OUTCOMES
from server.router.metrics import MIGRATION_OUTCOMES, WORKER_COUNTERS, WORKER_HISTOGRAMS
from server.router.registry import WorkerSpec
from transfer.wire.protocol import HistogramData, WorkerStats

JS_DIR = Path(__file__).resolve().parents[2] / "server/router/static"
JS = (JS_DIR / "dashboard.js").read_text()


class _Client:
    def abort(self, rids, reason):
        pass


def _exported() -> set[str]:
    """Every sample name ``/metrics`` has with one decode and one prefill worker reporting every
    counter and histogram the router knows, one observed request and one shed one."""
    ctx = build_context(
        PdserveConfig(),
        None,
        "m",
        [WorkerSpec("d0", "decode", "tcp://x"), WorkerSpec("p0", "prefill", "tcp://y")],
        lambda *a: _Client(),
    )
    counters = {k: 1.0 for k in WORKER_COUNTERS}
    counters |= {f"migrations_{d}_{o}": 1.0 for d, outs in MIGRATION_OUTCOMES.items() for o in outs}
    hist = {k: HistogramData(buckets=[0.1, 1.0], counts=[1, 0, 0], sum=0.05) for k in WORKER_HISTOGRAMS}
    gauges = {
        "kv_pages_free": 1.0,
        "kv_pages_used": 1.0,
        "kv_pages_cached": 0.0,
        "kv_pages_total": 2.0,
        "queue_running": 1.0,
        "new_token_ratio": 0.5,
        "host_kv_pool_bytes_used": 0.0,
        "host_kv_pool_bytes_free": 1.0,
    }
    for wid, role in (("d0", "decode"), ("p0", "prefill")):
        ctx.registry.on_stats(
            wid,
            WorkerStats(
                worker_id=wid,
                instance="a",
                role=role,
                model="m",
                capacity_tokens=64,
                max_model_len=64,
                page_size=16,
                counters=counters,
                gauges=gauges,
                histograms=hist,
            ),
        )
    ctx.metrics.observe_request(200)
    ctx.metrics.observe_shed("queue_full")  # a labelled counter has samples once it moved
    ctx.metrics.failovers.labels(worker="d0", outcome="continued").inc()
    ctx.metrics.observe_role_switch("decode", "prefill", "admin")
    ctx.metrics.observe_latency(0.1, 0.01, 0.5, 0.001)
    names = set()
    for fam in text_string_to_metric_families(ctx.metrics.render().decode()):
        names |= {s.name for s in fam.samples}
    return names


def test_every_series_the_page_names_is_exported():
    named = set(re.findall(r'"(pdserve_[a-z0-9_]+)"', JS))
    hists = set(re.findall(r'hist: "(pdserve_[a-z0-9_]+)"', JS))
    for name in ("ttft", "tpot", "queue_wait"):  # latencyTiles builds these from a template
        named.add(f"pdserve_{name}_seconds_count")
        hists.add(f"pdserve_{name}_seconds")
    assert {
        "pdserve_migrations_total",
        "pdserve_migration_bytes_total",
        "pdserve_migration_seconds_count",
        "pdserve_migration_seconds",
        "pdserve_role_switches_total",
    } <= named | hists  # the migration panel and the role timeline's tiles are there
    exported = _exported()
    missing = sorted(n for n in named - hists if n not in exported)
    missing += sorted(h for h in hists if f"{h}_bucket" not in exported)
    assert missing == [], f"dashboard.js names series /metrics does not export: {missing}"


def test_migration_panel_reads_the_counters_decode_workers_report():
    """The counter keys the panel and its markers read are the ones ``/metrics`` maps to
    ``pdserve_migrations_total{direction,outcome}``, ``pdserve_migration_bytes_total`` and
    ``pdserve_migration_seconds`` (so a marker per migration follows the same numbers)."""
    read = set(re.findall(r'"(migrations_(?:out|in)_[a-z]+)"', JS))
    assert read == {"migrations_out_done", "migrations_in_done", "migrations_out_failed", "migrations_in_failed"}
    assert all(k.split("_")[2] in MIGRATION_OUTCOMES[k.split("_")[1]] for k in read)
    outcomes = re.search(r'\[\["out", \[([^]]*)\]\], \["in", \[([^]]*)\]\]\]', JS)
    assert outcomes, "the panel's direction/outcome table moved: update this test"
    assert [re.findall(r'"(\w+)"', g) for g in outcomes.groups()] == [
        list(MIGRATION_OUTCOMES["out"]),
        list(MIGRATION_OUTCOMES["in"]),
    ]
    assert "migration_bytes" in WORKER_COUNTERS and "migration_seconds" in WORKER_HISTOGRAMS
    assert "delta.migration_bytes" in JS and "w.histograms.migration_seconds" in JS


def test_failover_markers_name_every_outcome_the_router_counts():
    """The page words a marker for each ``pdserve_failovers_total`` outcome (an unknown one would
    show its raw name)."""
    table = re.search(r"const FAILOVER_TEXT = \{(.*?)\};", JS, re.S)
    assert table, "the page's failover outcome table moved: update this test"
    assert set(re.findall(r"(\w+): \"", table.group(1))) == set(FAILOVER_OUTCOMES)


def test_snapshot_carries_the_failover_series_as_metrics_counts_them():
    """``/dashboard/data`` shows failovers by worker and outcome, the recomputed tokens and the
    stall histogram, moved by exactly what the router counted."""
    ctx = build_context(PdserveConfig(), None, "m", [WorkerSpec("c0", "colocated", "tcp://x")], lambda *a: _Client())
    before = snapshot(ctx).router
    assert before.failovers == {} and before.failover_recomputed == 0 and sum(before.failover_stall.counts) == 0
    m = ctx.metrics
    m.failovers.labels(worker="c0", outcome="continued").inc(2)
    m.failovers.labels(worker="c0", outcome="limit").inc()
    m.failover_recomputed.inc(17)
    m.failover_stall.observe(0.3)
    m.failover_stall.observe(0.7)
    after = snapshot(ctx).router
    assert after.failovers == {"c0": {"continued": 2.0, "limit": 1.0}}
    assert after.failover_recomputed == 17
    assert sum(after.failover_stall.counts) == 2 and after.failover_stall.sum == pytest.approx(1.0)


def test_snapshot_carries_the_role_switches_as_metrics_counts_them():
    """``/dashboard/data`` lists the completed role switches by old role, new role and reason,
    moved by exactly what the router counted, and each worker's role now."""
    specs = [WorkerSpec("p0", "prefill", "tcp://x"), WorkerSpec("d0", "decode", "tcp://y")]
    ctx = build_context(PdserveConfig(), None, "m", specs, lambda *a: _Client())
    assert snapshot(ctx).router.role_switches == []
    ctx.metrics.observe_role_switch("decode", "prefill", "admin")
    ctx.metrics.observe_role_switch("decode", "prefill", "planner")
    ctx.metrics.observe_role_switch("decode", "prefill", "planner")
    got = [(c.old, c.new, c.reason, c.count) for c in snapshot(ctx).router.role_switches]
    assert got == [("decode", "prefill", "admin", 1.0), ("decode", "prefill", "planner", 2.0)]
    ctx.registry.handles["d0"].spec = WorkerSpec("d0", "prefill", "tcp://y")
    assert [(w.id, w.role) for w in snapshot(ctx).workers] == [("p0", "prefill"), ("d0", "prefill")]


def test_the_role_timeline_script_is_served_and_loaded_before_the_page_script():
    """The page loads ``roles.js`` (``PdRoles``) before ``dashboard.js``, which draws with it."""
    html = (JS_DIR / "dashboard.html").read_text()
    assert "roles.js" in ASSETS and html.index("static/roles.js") < html.index("static/dashboard.js")
    assert "PdRoles.ingest(snap" in JS and "PdRoles.render(" in JS
    assert "const PdRoles" in (JS_DIR / "roles.js").read_text()
