"""Unit: the dashboard's speculative decoding panel shows a worker's draft series as ``/metrics``
counts them, and moves by exactly what the worker's counters and acceptance histogram moved.

The panel's tiles are computed by ``server/router/static/spec.js`` (``PdSpec.tiles``) from the
``/dashboard/data`` snapshot alone; it runs here under node on the snapshot the router builds."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from configs.schema import PdserveConfig
from server.router.app import build_context
from server.router.dashboard import ASSETS, snapshot
from server.router.registry import WorkerSpec
from tests.router.test_dashboard_series import _exported
from transfer.wire.protocol import HistogramData, WorkerStats

SPEC_JS = Path(__file__).resolve().parents[2] / "server/router/static/spec.js"
NODE = shutil.which("node")
BUCKETS = [0.0, 1.0, 2.0, 3.0, 4.0]


class _Client:
    def abort(self, rids, reason):
        pass


def report(ctx, drafted: int, accepted: int, rows_by_accepted: list[int]) -> None:
    """Worker c0 reports ``drafted`` / ``accepted`` draft tokens and ``rows_by_accepted[n]`` rows
    that accepted n tokens (cumulative, as a worker's stats are)."""
    hist = HistogramData(
        buckets=BUCKETS,
        counts=[*rows_by_accepted, 0],
        sum=float(sum(n * c for n, c in enumerate(rows_by_accepted))),
    )
    stats = WorkerStats(
        worker_id="c0",
        instance="a",
        role="colocated",
        model="m",
        capacity_tokens=64,
        max_model_len=64,
        page_size=16,
        counters={"spec_draft_tokens": float(drafted), "spec_accepted_tokens": float(accepted)},
        gauges={},
        histograms={"spec_acceptance_length": hist},
    )
    ctx.registry.on_stats("c0", stats)


def shown(ctx) -> dict[str, dict]:
    """The panel's tiles for the router's snapshot, by label (``PdSpec.tiles`` run by node)."""
    snap = json.dumps(snapshot(ctx).model_dump())
    script = f"const t = require({json.dumps(str(SPEC_JS))}).tiles({snap}); console.log(JSON.stringify(t));"
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, check=True, timeout=30)
    return {t["label"]: t for t in json.loads(out.stdout)}


def metrics(ctx) -> dict[str, float]:
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(ctx.metrics.render().decode())
        for s in fam.samples
        if s.name.startswith("pdserve_spec_") and s.labels.get("worker") == "c0" and "le" not in s.labels
    }


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_spec_tiles_move_by_what_the_worker_counted():
    ctx = build_context(PdserveConfig(), None, "m", [WorkerSpec("c0", "colocated", "tcp://x")], lambda *a: _Client())
    assert shown(ctx) == {}  # no stats yet: no tiles
    report(ctx, drafted=10, accepted=6, rows_by_accepted=[1, 1, 2, 0, 0])  # rows accepting 0, 1, 2, 2
    before = shown(ctx)
    assert before["c0 draft tokens"]["value"] == 10 and before["accepted"]["value"] == 6
    assert before["acceptance"]["text"] == "60.0%" and before["rows drafted"]["value"] == 4
    assert before["accepted per row"]["text"] == "1.25"  # (0 + 1 + 2 + 2) / 4
    m = metrics(ctx)  # each tile that names a series shows its /metrics value
    for tile in before.values():
        if "metric" in tile:
            assert tile["labels"] == {"worker": "c0"} and m[tile["metric"]] == tile["value"], tile

    report(ctx, drafted=18, accepted=11, rows_by_accepted=[1, 1, 2, 0, 1])  # one more row, 4 accepted of 4
    after = shown(ctx)
    assert after["c0 draft tokens"]["value"] - before["c0 draft tokens"]["value"] == 8
    assert after["accepted"]["value"] - before["accepted"]["value"] == 5
    assert after["rows drafted"]["value"] - before["rows drafted"]["value"] == 1
    assert after["acceptance"]["text"] == "61.1%" and after["accepted per row"]["text"] == "1.80"
    assert metrics(ctx)["pdserve_spec_accepted_tokens_total"] == 11


def test_the_panel_script_is_served_and_names_exported_series():
    html = (SPEC_JS.parent / "dashboard.html").read_text()
    assert "spec.js" in ASSETS and html.index("static/spec.js") < html.index("static/dashboard.js")
    assert 'data-panel="spec"' in html and 'id="spec-tiles"' in html
    text = SPEC_JS.read_text()
    named = {n for n in _exported() if n.startswith("pdserve_spec_") and f'"{n}"' in text}
    assert named == {
        "pdserve_spec_draft_tokens_total",
        "pdserve_spec_accepted_tokens_total",
        "pdserve_spec_acceptance_length_count",
    }
