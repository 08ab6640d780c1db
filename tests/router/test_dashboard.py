"""The live dashboard (``/dashboard``, ``/dashboard/data``) against a launched PD server.

One ``pdserve launch --mode pd`` with an API key and a small KV pool (24 pages of 16 tokens, a
2-page host pool, so short retracted requests offload and longer ones recompute) so that 10 concurrent requests cause
a retract storm; ``--retract-test-interval`` adds a forced retract every 12 decode steps so that the
storm has events even when this shared machine is too slow to fill the pool fast. ``/dashboard/data`` is
checked over HTTP (key required, values equal ``/metrics``); the page is loaded in headless
Chromium (Debian's ``chromium``, driven over the DevTools protocol on a pipe): it asks for the key,
shows every panel under load, its numbers equal ``/metrics`` once the server is idle, retract events
appear as markers, a killed worker turns red with its reason, and no JavaScript error is logged.
Screenshots (``dashboard.png`` under load, ``dashboard-idle.png``, ``dashboard-dead.png``) land in
the test's tmp dir, and at ``$PDSERVE_DASHBOARD_SCREENSHOT`` (the first) and beside it when set.
The tests share one server and one page and run in file order.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.harness.subprocess_server import LaunchedServer, fresh_metrics, wait_idle
from configs.schema import PdserveConfig
from server.router.app import build_context
from server.router.dashboard import snapshot
from server.router.metrics import LATENCY_BUCKETS
from server.router.registry import WorkerSpec
from tests.router.dashboard_dom import mismatches, page_errors, panel_fill, worker_row
from tests.support.chromium_cdp import Browser, find_chromium
from transfer.wire.protocol import HistogramData, WorkerStats

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.5
WORKER_TIMEOUT_S = 10.0
KEY = "dashboard-test-key"
POOL_TOKENS = 384  # 24 pages: 10 requests of ~40 + 40 tokens need ~50, so decode retracts for memory
STORM = (10, 40)  # concurrent requests, tokens each (small: this machine is shared and slow)
SHARED = (
    "You are a helpful assistant that answers questions about geography, history and science "
    "in one short paragraph. Question: "
)
QUESTIONS = [
    "Why is the sky blue?",
    "Who built the pyramids?",
    "What is photosynthesis?",
    "Where is Mount Everest?",
    "When did the Roman Empire fall?",
    "How do volcanoes form?",
    "What causes tides?",
    "Why do leaves change color?",
]
CHROMIUM = find_chromium()
NO_CHROMIUM = (
    "\n" + "!" * 100 + "\n!!! CHROMIUM IS NOT INSTALLED: the dashboard BROWSER tests DID NOT RUN.\n"
    "!!! Install it as root: apt-get install -y chromium chromium-driver (.ci/run does, and sets\n"
    "!!! PDSERVE_REQUIRE_CHROMIUM=1 so that CI fails instead of skipping).\n" + "!" * 100
)
AUTH = {"Authorization": f"Bearer {KEY}"}
# every series the page must show with its /metrics value (a subset check would let panels rot)
REQUIRED_SERIES = {
    "pdserve_worker_up",
    "pdserve_kv_pool_pages",
    "pdserve_host_kv_pool_bytes",
    "pdserve_queue_requests",
    "pdserve_new_token_ratio",
    "pdserve_retractions_total",
    "pdserve_retract_resumed_total",
    "pdserve_oom_aborts_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_transfer_seconds_count",
    "pdserve_transfer_failures_total",
    "pdserve_requests_total",
    "pdserve_inflight_requests",
    "pdserve_ttft_seconds_count",
    "pdserve_tpot_seconds_count",
    "pdserve_generation_tokens_total",
    "pdserve_migrations_total",
    "pdserve_migration_bytes_total",
    "pdserve_migration_seconds_count",
}
PANELS = ("workers", "pools", "queues", "retract", "transfer", "migration", "requests")
IDLE_PANELS = {
    "migration"
}  # drawn, but flat here: this server has one decode worker (tests/e2e/test_migration_e2e.py moves)


def need_chromium() -> str:
    if CHROMIUM:
        return CHROMIUM
    if os.environ.get("PDSERVE_REQUIRE_CHROMIUM") == "1":
        pytest.fail(NO_CHROMIUM)
    pytest.skip(NO_CHROMIUM)


@pytest.fixture(scope="module")
def server(launched_server):
    return launched_server(
        "pd",
        "--api-key",
        KEY,
        "--kv-pool-tokens",
        str(POOL_TOKENS),
        "--page-size",
        "16",
        "--max-model-len",
        "1024",
        "--host-kv-pool-gb",
        "0.002",
        "--init-new-token-ratio",
        "0.05",
        "--retract-test-interval",
        "12",
        "--peer-timeout-s",
        "30",
        "--bootstrap-timeout-s",
        "900",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--worker-timeout-s",
        str(WORKER_TIMEOUT_S),
        "--log-level",
        "WARNING",
    )


@pytest.fixture(scope="module")
def url(server):
    return server.url


@pytest.fixture(scope="module")
def page(request):
    executable = need_chromium()  # before the server: skipping should not cost a launch
    url = request.getfixturevalue("url")
    with Browser(executable) as browser:
        p = browser.open()
        p.navigate(f"{url}/dashboard")
        yield p


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    """Where screenshots go: the test's tmp dir, plus $PDSERVE_DASHBOARD_SCREENSHOT's folder when set."""
    return tmp_path_factory.mktemp("dashboard")


def save_shot(page, shots: Path, name: str) -> Path:
    path = page.screenshot(shots / name)
    if target := os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT"):  # the main shot there, the others beside it
        dest = Path(target) if name == "dashboard.png" else Path(target).with_name(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
    assert path.stat().st_size > 20_000, f"{path} is suspiciously small for a full page"
    return path


def data(url: str) -> dict:
    r = httpx.get(f"{url}/dashboard/data", headers=AUTH, timeout=10, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def worker_pid(server: LaunchedServer, role: str) -> int:
    for pid in server.worker_pids():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--role" in cmd and cmd[cmd.index(b"--role") + 1] == role.encode():
            return pid
    raise LookupError(f"no {role} worker")


# ---- load ----------------------------------------------------------------------------------------
def storm(url: str, model: str, n: int = 32, max_tokens: int = 64) -> list:
    """``n`` concurrent streamed completions (shared prefix, ``ignore_eos``): each one's token count,
    or its exception."""

    async def one(c, i):
        r = await c.completions.create(
            model=model,
            prompt=SHARED + QUESTIONS[i % len(QUESTIONS)] + " " * (i // 8),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids = []
        async for chunk in r:
            if chunk.choices:
                ids += getattr(chunk.choices[0], "token_ids", None) or []
        return len(ids)

    async def run():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(n)), return_exceptions=True)
        finally:
            await c.close()

    return asyncio.run(run())


# ---- tests ---------------------------------------------------------------------------------------
def test_snapshot_follows_the_registry_and_router_metrics():
    """Unit: worker states starting -> ready -> dead -> restarting -> ready, uptime per process
    instance, stats passed through as received, router counters and histograms as /metrics has them."""
    now = [100.0]

    class Client:
        def abort(self, rids, reason):
            pass

    ctx = build_context(PdserveConfig(), None, "m", [WorkerSpec("d0", "decode", "tcp://x")], lambda *a: Client())
    ctx.registry.clock = clock = lambda: now[0]

    def stats(instance: str) -> WorkerStats:
        hist = HistogramData(buckets=[0.1, 1.0], counts=[1, 2, 0], sum=1.5)
        return WorkerStats(
            worker_id="d0",
            instance=instance,
            role="decode",
            model="m",
            capacity_tokens=64,
            max_model_len=64,
            page_size=16,
            counters={"retractions": 3.0},
            gauges={"kv_pages_free": 2.0},
            histograms={"kv_transfer_seconds": hist},
        )

    def worker():
        return snapshot(ctx, clock).workers[0]

    assert (worker().state, worker().up, worker().uptime_s, worker().model) == ("starting", False, None, None)
    ctx.registry.on_stats("d0", stats("a"))
    now[0] = 130.0
    w = worker()
    assert (w.state, w.up, w.uptime_s, w.stats_age_s, w.restarts, w.model) == ("ready", True, 30.0, 30.0, 0, "m")
    assert w.counters == {"retractions": 3.0} and w.gauges == {"kv_pages_free": 2.0}
    assert w.histograms["kv_transfer_seconds"].counts == [1, 2, 0]
    ctx.registry.mark_dead("d0", "worker process exited with code -9")
    assert (worker().state, worker().up, worker().reason) == ("dead", False, "worker process exited with code -9")
    now[0] = 140.0
    ctx.registry.mark_restarting("d0", "restarting: the previous process exited with code -9")  # still loading
    assert (worker().state, worker().restarts, worker().reason) == (
        "restarting",
        0,
        "restarting: the previous process exited with code -9",
    )
    ctx.registry.on_stats("d0", stats("b"))
    now[0] = 145.0
    assert (worker().state, worker().restarts, worker().uptime_s, worker().reason) == ("ready", 1, 5.0, "")

    for status in (200, 200, 503):
        ctx.metrics.observe_request(status)
    ctx.metrics.observe_latency(0.3, 0.02, 1.0)
    r = snapshot(ctx, clock).router
    assert r.requests == {"200": 2.0, "503": 1.0} and r.inflight == 0
    assert r.ttft.buckets == list(LATENCY_BUCKETS) and len(r.ttft.counts) == len(LATENCY_BUCKETS) + 1
    assert r.ttft.counts[LATENCY_BUCKETS.index(0.5)] == 1 == sum(r.ttft.counts) and r.ttft.sum == 0.3
    assert r.tpot.counts[LATENCY_BUCKETS.index(0.025)] == 1 and r.e2e.counts[LATENCY_BUCKETS.index(1.0)] == 1


def test_data_needs_the_key_and_assets_are_local(url):
    page = httpx.get(f"{url}/dashboard", timeout=10, trust_env=False)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("dashboard.js", "javascript"), ("chart.js", "javascript"), ("dashboard.css", "css")):
        asset = httpx.get(f"{url}/dashboard/static/{name}", timeout=10, trust_env=False)
        assert asset.status_code == 200 and kind in asset.headers["content-type"], name
        assert "://" not in asset.text.replace("http://www.w3.org/2000/svg", ""), f"{name} loads something remote"
    assert "://" not in page.text
    missing = httpx.get(f"{url}/dashboard/static/app.py", timeout=10, trust_env=False)
    assert missing.status_code == 404 and "dashboard.js" in missing.json()["error"]["message"]

    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{url}/dashboard/data", headers=headers, timeout=10, trust_env=False)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.json()["error"]["message"]
    snap = data(url)
    assert snap["version"] == 1 and snap["mode"] == "pd" and snap["healthy"] is True
    assert sorted((w["role"], w["state"], w["up"]) for w in snap["workers"]) == [
        ("decode", "ready", True),
        ("prefill", "ready", True),
    ]
    assert all(w["uptime_s"] > 0 and w["model"] == snap["model"] for w in snap["workers"])


def test_data_equals_metrics(url):
    model = data(url)["model"]
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300) as c:
        for q in QUESTIONS[:3]:
            c.completions.create(model=model, prompt=SHARED + q, max_tokens=8, temperature=0)
    wait_idle(url, HEARTBEAT_S, timeout_s=60)
    m, snap = fresh_metrics(url, HEARTBEAT_S), data(url)
    r = snap["router"]
    assert r["requests"]["200"] == m[("pdserve_requests_total", (("status", "200"),))] >= 3
    for name in ("ttft", "tpot", "e2e"):
        assert sum(r[name]["counts"]) == m[(f"pdserve_{name}_seconds_count", ())] >= 3
        assert math.isclose(r[name]["sum"], m[(f"pdserve_{name}_seconds_sum", ())])
    for w in snap["workers"]:
        lab = (("worker", w["id"]),)
        assert w["counters"]["generation_tokens"] == m[("pdserve_generation_tokens_total", lab)]
        for state in ("free", "used", "cached"):
            assert w["gauges"][f"kv_pages_{state}"] == m[("pdserve_kv_pool_pages", (("state", state), *lab))]
    prefill = next(w for w in snap["workers"] if w["role"] == "prefill")
    assert (
        sum(prefill["histograms"]["kv_transfer_seconds"]["counts"])
        == m[("pdserve_kv_transfer_seconds_count", (("worker", prefill["id"]),))]
        >= 3
    )


def signed_in(page):
    """``page`` with the API key entered (as a user does on the form) and its workers shown: every test
    that reads the panels starts from here, so that none relies on the key test having run first."""
    if page.evaluate("sessionStorage.getItem('pdserve.apiKey')") != KEY:
        page.wait_for("!document.getElementById('keyform').hidden", 15)  # the poll stopped at its 401
        page.evaluate(
            f"document.getElementById('key').value = '{KEY}'; document.getElementById('keyform').requestSubmit()"
        )
    page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2", 15)
    return page


def test_page_asks_for_the_key(page):
    if page.evaluate("sessionStorage.getItem('pdserve.apiKey')") is not None:  # signed in by a test before
        page.evaluate("sessionStorage.clear()")
        page.navigate(page.evaluate("location.href"))
    page.wait_for("!document.getElementById('keyform').hidden", 15)
    assert page.evaluate("document.querySelectorAll('#workers tbody tr').length") == 0
    page.evaluate("document.getElementById('key').value = 'wrong'; document.getElementById('keyform').requestSubmit()")
    page.wait_for("document.getElementById('keyerror').textContent.includes('refused')", 15)
    page.evaluate(f"document.getElementById('key').value = '{KEY}'; document.getElementById('keyform').requestSubmit()")
    page.wait_for("document.querySelectorAll('#workers tbody tr').length === 2", 15)
    assert page.evaluate("document.getElementById('keyform').hidden") is True
    assert page.evaluate("sessionStorage.getItem('pdserve.apiKey')") == KEY
    assert page_errors(page, allowed_401=True) == []


def test_page_through_a_retract_storm(page, url, shots):
    signed_in(page)
    model, peaks, results = data(url)["model"], {}, {}
    load = threading.Thread(target=lambda: results.update(out=storm(url, model, *STORM)), daemon=True)
    load.start()
    shot_taken = False
    while load.is_alive():  # watch the storm through the JSON the page reads; shoot the page at its worst
        snap = data(url)
        for w in snap["workers"]:
            for k, v in w["gauges"].items():
                peaks[f"{w['id']}.{k}"] = max(v, peaks.get(f"{w['id']}.{k}", 0))
        decode = next(w for w in snap["workers"] if w["role"] == "decode")
        if not shot_taken and decode["gauges"].get("queue_running", 0) > 0 and decode["counters"]["retractions"] >= 3:
            page.evaluate("document.querySelector('#spans button[data-span=\"300\"]').click()")
            time.sleep(1.5)  # a fresh poll at the 5 minute view: the README's picture under load
            save_shot(page, shots, "dashboard.png")
            page.evaluate("document.querySelector('#spans button[data-span=\"600\"]').click()")
            shot_taken = True
        load.join(1.0)
    if not shot_taken:
        save_shot(page, shots, "dashboard.png")
    out = results["out"]
    assert [x for x in out if isinstance(x, BaseException)] == [] and out == [STORM[1]] * STORM[0]

    m = wait_idle(url, HEARTBEAT_S, timeout_s=60)
    assert m[("pdserve_retractions_total", (("worker", "decode-0"),))] > 0, "the storm did not retract: pool too big?"
    deadline = time.monotonic() + 15
    while (bad := mismatches(page, fresh_metrics(url, HEARTBEAT_S), REQUIRED_SERIES)) and time.monotonic() < deadline:
        time.sleep(1.2)  # the page polls every second; once idle, its numbers must settle on /metrics'
    assert bad == []

    fill = panel_fill(page)
    # the role timeline draws bands, not series; the speculative panel's figures are test_dashboard_spec.py's
    assert set(fill) == {*PANELS, "roles", "spec"}
    bands = page.evaluate("[...document.querySelectorAll('[data-panel=roles] rect.band')].map(b => b.dataset.role)")
    assert set(bands) == {"prefill", "decode"}, bands
    assert fill["workers"][0] == 2
    for panel in PANELS[1:]:
        rows, series, top = fill[panel]
        assert series >= 1 and (top > 0 or panel in IDLE_PANELS), f"panel {panel} is empty: {fill[panel]}"
    markers = page.evaluate("document.querySelectorAll('[data-panel=retract] svg g.marker.retract').length")
    events = page.evaluate("[...document.querySelectorAll('#retract-events li.retract')].map(e => e.textContent)")
    assert markers >= 2 and events and all("tokens freed" in e and "offload" in e for e in events)
    shot = save_shot(page, shots, "dashboard-idle.png")
    summary = {
        "peaks": peaks,
        "events": events,
        "markers": markers,
        "screenshot": str(shot),
        "tiles": page.evaluate("[...document.querySelectorAll('.tile')].map(t => t.innerText.replace('\\n', ': '))"),
        "metrics": {
            f"{n}{dict(lab)}": v
            for (n, lab), v in m.items()
            if n.startswith(("pdserve_retract", "pdserve_oom", "pdserve_kv_transfer_bytes"))
        },
    }
    (shots / "storm-summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    assert page_errors(page, allowed_401=True) == []


def test_killed_worker_turns_red_with_its_reason(page, server, url, shots):
    signed_in(page)
    decode = next(w for w in data(url)["workers"] if w["role"] == "decode")["id"]
    pid = worker_pid(server, "decode")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # dead, and 'restarting' as soon as the launcher has started a new process for it; the router may
    # see the closed control connection first (that reason), the launcher's exit notice (naming the
    # exit code) follows at its next poll
    row_sel = f'document.querySelector(\'#workers tr[data-worker="{decode}"] '
    page.wait_for(
        f"['dead', 'restarting'].includes({row_sel}.badge').textContent) && "
        f"{row_sel}.reason').textContent.includes('exited with code -9')",
        WORKER_TIMEOUT_S,
    )
    seen_after = time.monotonic() - t0
    row = worker_row(page, decode)
    assert ("state-dead" in row["cls"] and row["color"] == "rgb(253, 232, 232)") or (
        "state-restarting" in row["cls"] and row["color"] == "rgb(253, 243, 224)"
    ), row
    assert "exited with code -9" in row["reason"], row
    assert page.evaluate("document.getElementById('health').textContent") == "degraded"
    save_shot(page, shots, "dashboard-dead.png")
    print(f"decode worker shown dead {seen_after:.2f}s after SIGKILL: {row['reason']}")
    page.wait_for(
        f"document.querySelector('#workers tr[data-worker=\"{decode}\"] .badge').textContent === 'ready'",
        180,
        poll_s=1.0,
    )
    row = worker_row(page, decode)
    assert "restarts: 1" in row["text"] and row["reason"] == "", row
    assert page_errors(page, allowed_401=True) == []
