"""benchmarks.migration_bench's arithmetic: the serve goal's two ratios and the cores it pins. The
per-run ratio compares each run's own retracted requests; the matched one follows the requests
retracted without migration into the run with it, so a shape whose retracted sets differ between
the runs cannot pass on the difference alone."""

from __future__ import annotations

import pytest

from benchmarks.migration_bench import goal_lines
from benchmarks.migration_serve import (
    LONG_PREFIX,
    long_prefix,
    matched_p99_ratio,
    percentile,
    serve_goal_met,
    split_decode_cpus,
    summarize,
)

pytestmark = pytest.mark.unit


def req(e2e: float, retracted: bool) -> dict:
    return {"e2e": e2e, "max_gap": 1.0 if retracted else 0.1, "retracted": retracted}


def test_percentile_takes_the_value_at_q_n_and_the_last_at_most():
    assert percentile([], 0.99) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile([float(i) for i in range(200)], 0.99) == 198.0


def test_a_run_summary_takes_every_quantile_the_same_way():
    """Twelve requests, two parked (longest gap over 5x the median gap): every P99 is the largest
    value (``percentile``); before, every request's P99 took the second largest of twelve."""
    rows = [{"e2e": 3.0 + i / 10, "gaps": [0.05] * 4, "max_gap": 0.05, "error": None, "ids": [i]} for i in range(10)]
    rows += [
        {"e2e": 5.0, "gaps": [0.05, 1.2], "max_gap": 1.2, "error": None, "ids": [10]},
        {"e2e": 4.5, "gaps": [0.05, 0.9], "max_gap": 0.9, "error": "aborted", "ids": [11]},
    ]
    s = summarize(rows, gap_factor=5.0)
    assert s["failed"] == 1 and s["retracted_requests"] == 2
    assert (s["p50_s"], s["p99_s"], s["stall_p99_s"], s["all_p99_s"]) == (5.0, 5.0, 1.2, 5.0)
    assert [r["retracted"] for r in s["requests"]] == [False] * 10 + [True, True]
    assert s["ids"] == [[i] for i in range(12)]


def test_matched_ratio_follows_the_requests_retracted_without_migration():
    # without: the long request 0 (12.4 s) and the short ones 1-2 were parked; with: only the short ones,
    # and the long one took as long unparked. Per run: 5.7 / 12.4 = 0.46; for the same requests: 12.2 / 12.4.
    off = [req(12.4, True), req(7.1, True), req(8.2, True), req(4.5, False)]
    on = [req(12.2, False), req(5.5, True), req(5.7, True), req(5.4, False)]
    assert matched_p99_ratio(off, on) == pytest.approx(12.2 / 12.4)
    assert matched_p99_ratio(off[1:], on[1:]) == pytest.approx(5.7 / 8.2)
    assert matched_p99_ratio([req(1.0, False)], [req(1.0, True)]) is None  # nothing retracted without migration


def test_the_goal_needs_both_ratios_and_prints_both():
    assert serve_goal_met(0.45, 0.49, True, 0)
    assert not serve_goal_met(0.458, 0.984, True, 0)  # met per run, not for the same requests
    assert not serve_goal_met(0.6, 0.4, True, 0)
    assert not serve_goal_met(0.45, None, True, 0)
    assert not serve_goal_met(0.45, 0.45, False, 0) and not serve_goal_met(0.45, 0.45, True, 1)
    serve = {
        "with": {"p99_s": 5.68, "failed": 0, "migrations": 4.0, "retracted_requests": 4, "all_p99_s": 5.7},
        "without": {"p99_s": 12.4, "failed": 0, "retracted_requests": 5, "all_p99_s": 12.4},
        "tokens_identical": True,
        "p99_ratio": 0.458,
        "matched_p99_ratio": 0.984,
        "stall_p99_ratio": 0.17,
        "goal_met": False,
    }
    (line,) = goal_lines({"serve": serve})
    assert "= 0.458 (5.68s / 12.4s), of the requests retracted without it 0.984 (goal: both <= 0.5)" in line
    assert "their longest stall's P99 0.17x" in line
    assert line.endswith("NOT met")


def test_the_prefill_worker_shares_the_peers_half_not_the_loaded_workers_core():
    assert split_decode_cpus(1) == []
    assert split_decode_cpus(2) == ["--worker-cpus", "prefill-0=1,decode-0=0,decode-1=1"]
    assert split_decode_cpus(8, 3) == ["--worker-cpus", "prefill-0=4-7,decode-0=0-3,decode-1=4-7,decode-2=4-7"]


def test_long_prefix_opens_with_that_many_words_of_notes():
    assert long_prefix(0) == LONG_PREFIX
    head = long_prefix(450)
    notes = head.removeprefix("Background for a long report. ").split("\n\n")[0]
    assert len(notes.split()) == 450 and head.endswith(LONG_PREFIX)
