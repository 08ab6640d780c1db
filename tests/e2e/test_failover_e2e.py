"""Failover end to end: ``pdserve launch --replicas 2`` (two colocated worker processes behind the
router, the real model) and ``--mode pd --decode 2``, a streamed greedy (or seeded) completion, and
``kill -9`` of the worker serving it mid-stream. The launcher sees its child exit, the router sends
the request on as a continuation (prompt + the tokens streamed so far) to the other replica or
decode worker, and the client's stream completes with the text, token ids, finish reason and usage
of a fault-free run: no error chunk, no duplicate, no gap. ``pdserve_failovers_total{outcome=
"continued"}`` moves by one per choice and the recomputed tokens by the tokens streamed before the
kill; afterwards no KV page or in-flight entry is left. On the replicas' launch the dashboard, open
in headless Chromium through one such kill, marks the failover and its tiles equal ``/metrics``."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from bench.harness.subprocess_server import LaunchedServer, fresh_metrics, metric_sum, scrape_metrics, wait_idle
from benchmarks.failover_load import STORY, stream, worker_pid
from tests.router.dashboard_dom import dom_values, histogram_quantile
from tests.support.chromium_cdp import optional_browser

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEW_TOKENS = 64
KILL_AFTER = 8  # tokens the client has when the serving replica is killed


def serving_worker(url: str, before: dict, workers: tuple[str, ...]) -> str:
    """The one of ``workers`` whose generated-token counter moved since ``before`` (fresh heartbeats)."""
    m = fresh_metrics(url, HEARTBEAT_S)
    moved = [
        w
        for w in workers
        if metric_sum(m, "pdserve_generation_tokens_total", worker=w)
        > metric_sum(before, "pdserve_generation_tokens_total", worker=w)
    ]
    assert len(moved) == 1, moved
    return moved[0]


# pools that hold every case's streams; heartbeats fast enough that a death is seen within a second;
# steps of at least STEP_DELAY_S, so a stream outlasts the killer's wait for fresh heartbeats
# (``serving_worker``): the stop-string case has about 34 tokens left after the kill, which a fast
# host with accepted drafts streamed before the kill landed
STEP_DELAY_S = 0.03
SERVER_FLAGS = ("--kv-pool-tokens", "2048", "--page-size", "16", "--log-level", "INFO")
SERVER_FLAGS += ("--health-interval-s", str(HEARTBEAT_S), "--test-step-delay-s", str(STEP_DELAY_S))


@pytest.fixture(scope="module")
def replicas(launched_server) -> LaunchedServer:
    return launched_server("colocated", "--replicas", "2", *SERVER_FLAGS)


# Seeded sampling with two choices failing over each on its own, logprobs, and a JSON schema whose
# matcher must continue. Greedy colocated failover is the stop-string, prompt-logprobs and dashboard
# rows' kill.
N2_SEEDED_JSON = {
    "temperature": 0.8,
    "seed": 99,
    "n": 2,
    "logprobs": 2,
    "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
}


def test_kill_the_serving_replica_mid_stream_n2_seeded_logprobs_json(replicas):
    kill_mid_stream(replicas, N2_SEEDED_JSON, ("colocated-0", "colocated-1"))


@pytest.fixture(scope="module")
def pd_pair(launched_server) -> LaunchedServer:
    return launched_server("pd", "--decode", "2", *SERVER_FLAGS)


def test_kill_the_serving_decode_worker_mid_stream(pd_pair):
    """1 prefill + 2 decode workers: the other decode worker has the prefill worker recompute prompt +
    output so far (its radix cache holds the prompt) and continues."""
    kill_mid_stream(pd_pair, {"temperature": 0}, ("decode-0", "decode-1"))


def test_a_stop_string_met_after_the_failover_and_echo_come_out_as_without_it(replicas):
    """``echo`` (the prompt before the first token) and a stop string first met well after the kill:
    the router's held-back text and the stop check carry on across the continuation, so the text
    ends right before the stop string as in the fault-free run, with ``finish_reason`` "stop"."""
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0}
    text = stream(replicas.url, body)["choices"][0]["text"]
    at = len(text) * 2 // 3  # about token 42 of 64, the kill is after 8
    stop = text[at : at + 5]
    assert text.find(stop) == at, (text, stop)  # first met there
    got = kill_mid_stream(
        replicas, {"temperature": 0, "stop": [stop], "echo": True}, ("colocated-0", "colocated-1"), finish="stop"
    )
    assert got["choices"][0]["text"] == PROMPT + text[:at]


def test_prompt_logprobs_go_out_once_across_a_failover(replicas):
    """``prompt_logprobs``: the first replica computes them and they go out with the opening chunk,
    before the kill; the client sees them once, those of the fault-free run (checked in
    ``kill_mid_stream``), one entry per prompt token. That the continuation does not ask for them
    again is not visible to a streaming client: ``tests/router/test_router_failover.py`` checks it."""
    got = kill_mid_stream(replicas, {"temperature": 0, "prompt_logprobs": 1}, ("colocated-0", "colocated-1"))
    (seen,) = got["choices"][0]["prompt_logprobs"]
    assert seen[0] is None and len(seen) == got["usage"]["prompt_tokens"] and all(seen[1:])


def test_a_failover_is_marked_on_the_dashboard(replicas):
    """The dashboard (``/dashboard`` in headless Chromium, open from before the kill) draws one
    "continued" failover marker on the requests panel's first chart for a greedy stream whose replica
    is killed mid-stream (``kill_mid_stream``'s checks), and its failover tiles (by worker and
    outcome, recomputed tokens, stall count and percentiles) equal ``/metrics``; no JavaScript error
    is logged. Markers count the failovers since the page opened; tiles are cumulative, as /metrics."""
    with optional_browser() as b:
        if b is None:
            pytest.skip("chromium is not installed")
        page = b.open()
        page.navigate(f"{replicas.url}/dashboard")
        page.wait_for("document.querySelectorAll('#requests-tiles .tile').length > 0", 30)
        killed = kill_mid_stream(replicas, {"temperature": 0}, ("colocated-0", "colocated-1"))["killed"]
        m = scrape_metrics(replicas.url)
        page.wait_for(f"{FAILOVER_MARKED} === 1", 15)
        # the page refreshes once a second: wait until it shows the values /metrics has once idle
        tile = json.dumps({"outcome": "continued", "worker": killed}, separators=(",", ":"))
        for metric, labels, value in (
            (
                "pdserve_failovers_total",
                tile,
                metric_sum(m, "pdserve_failovers_total", worker=killed, outcome="continued"),
            ),
            ("pdserve_failover_stall_seconds_count", "{}", metric_sum(m, "pdserve_failover_stall_seconds_count")),
            (
                "pdserve_failover_recomputed_tokens_total",
                "{}",
                metric_sum(m, "pdserve_failover_recomputed_tokens_total"),
            ),
        ):
            page.wait_for(
                f"[...document.querySelectorAll('[data-metric={metric}]')]"
                f".some((e) => e.dataset.labels === '{labels}' && e.dataset.value === '{int(value)}')",
                15,
            )
        assert failover_mismatches(page, scrape_metrics(replicas.url)) == []
        assert page.errors() == []


# the counts on the requests panel's failover markers (labels "↻N") of its first chart
FAILOVER_MARKED = """(() => { const svg = document.querySelector('#requests svg');
  return svg ? [...svg.querySelectorAll('g.marker.failover.continued text')]
    .reduce((a, t) => a + Number(t.textContent.slice(1)), 0) : 0; })()"""


def failover_mismatches(page, m: dict) -> list[str]:
    """The page's failover numbers (``pdserve_failover*``) that differ from the /metrics samples ``m``
    (or miss there)."""
    samples, quantiles = dom_values(page)
    bad = []
    for name, labels, value in samples:
        if name.startswith("pdserve_failover"):
            want = m.get((name, tuple(sorted(json.loads(labels).items()))))
            if want is None or float(value) != want:
                bad.append(f"{name}{labels}: page {value} != /metrics {want}")
    for hist, q, labels, value in quantiles:
        if hist.startswith("pdserve_failover"):
            want = histogram_quantile(float(q), m, hist, json.loads(labels))
            if want is None or abs(float(value) - want) > 1e-6 * max(1.0, want):
                bad.append(f"P{float(q) * 100:g} of {hist}: page {value} != /metrics {want}")
    return bad


def same_values(a, b, tol: float = 1e-3) -> bool:
    """``a`` and ``b`` equal but for floats within ``tol`` (nested lists and dicts)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_values(x, y, tol) for x, y in zip(a, b))
    return a == b


def kill_mid_stream(server: LaunchedServer, sampling: dict, workers: tuple[str, ...], finish: str = "length") -> dict:
    """Stream a reference run, then the same request with ``kill -9`` of the one of ``workers`` that
    serves it after ``KILL_AFTER`` tokens; the outputs, usage and failover counters are checked
    (each choice ends with ``finish``). Returns the faulted run's record."""
    n = sampling.get("n", 1)
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "ignore_eos": True, **sampling}
    reference = stream(server.url, body)
    assert not reference["errors"]
    assert finish != "length" or reference["usage"]["completion_tokens"] == n * NEW_TOKENS

    before = fresh_metrics(server.url, HEARTBEAT_S)
    reached, killed = threading.Event(), {}

    def on_chunk(out: dict) -> None:
        if out["tokens"] >= KILL_AFTER and not reached.is_set():
            reached.set()

    def killer() -> None:
        reached.wait(120)
        victim = serving_worker(server.url, before, workers)
        killed["worker"] = victim
        os.kill(worker_pid(server, victim), signal.SIGKILL)

    t = threading.Thread(target=killer)
    t.start()
    got = stream(server.url, body, on_chunk)
    t.join()
    assert killed.get("worker"), "the serving worker was not found"
    assert got["errors"] == []
    assert sorted(got["choices"]) == sorted(reference["choices"]) == list(range(n))
    for i, ref in reference["choices"].items():
        mine = got["choices"][i]
        assert mine["token_ids"] == ref["token_ids"] and mine["text"] == ref["text"], i
        assert mine["finish_reason"] == ref["finish_reason"] == finish
        assert mine["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-3)
        assert len(mine["prompt_logprobs"]) == len(ref["prompt_logprobs"]) == ("prompt_logprobs" in sampling)
        assert same_values(mine["prompt_logprobs"], ref["prompt_logprobs"]), i
        if "response_format" in sampling:
            assert re.match(r'\{\s*"title"\s*:\s*".*"\s*,\s*"story"\s*:\s*"', mine["text"], re.S), mine["text"][:80]
    assert got["usage"] == reference["usage"]

    m = scrape_metrics(server.url)

    def moved(name: str, **labels: str) -> float:
        return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

    outcomes = ("continued", "limit", "no_route", "unfit", "unreachable")
    assert {o: moved("pdserve_failovers_total", outcome=o) for o in outcomes} == {
        o: float(n if o == "continued" else 0) for o in outcomes
    }
    assert moved("pdserve_failovers_total", worker=killed["worker"], outcome="continued") == n
    recomputed = moved("pdserve_failover_recomputed_tokens_total")
    assert KILL_AFTER <= recomputed < n * NEW_TOKENS
    stall = moved("pdserve_failover_stall_seconds_sum")
    assert moved("pdserve_failover_stall_seconds_count") == n and 0 < stall <= n * (got["gap_s"] + 0.5)
    print(
        f"\nfailover of {killed['worker']} ({n} choice(s)): {recomputed:g} tokens recomputed, stall "
        f"{stall / n:.3f} s (router, mean), largest inter-token gap {got['gap_s']:.3f} s (client; "
        f"fault-free run {reference['gap_s']:.3f} s)"
    )
    assert f"worker {killed['worker']} is dead" in server.log()
    deadline = time.monotonic() + 120  # the launcher restarts the killed worker: wait for it, for the next case
    while time.monotonic() < deadline:
        if metric_sum(scrape_metrics(server.url), "pdserve_worker_up") == len(workers) + (workers[0][0] == "d"):
            break
        time.sleep(0.5)
    idle = wait_idle(server.url, HEARTBEAT_S)  # raises while a survivor holds KV pages or requests
    assert metric_sum(idle, "pdserve_inflight_requests") == 0
    return {**got, "killed": killed["worker"]}
