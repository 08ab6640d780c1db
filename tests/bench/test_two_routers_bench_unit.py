"""The in-process parts of ``pdserve bench two-routers``: flag checks, the spread, counter deltas,
what counts as a failed request, the per-phase tags, and the medians and B/A of the summary."""

from __future__ import annotations

import pytest

from bench import cli
from bench.multirouter.phases import PhaseResult, Snapshot, WorkerSplit, failed, split_between, spread, tagged
from bench.multirouter.table import Summary, phases_table
from bench.serve.client import RequestResult
from bench.serve.stats import compute_stats
from bench.serve.workload import RequestSpec, WordCounter


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--rounds", "0"], "--rounds >= 1"),
        (["--decode", "1"], "--decode >= 2"),
        (["--colocated", "1"], "N >= 2"),
        (["--input-len-range", "9,3"], "1 <= LO <= HI"),
        (["--input-len-range", "abc"], "takes LO,HI"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, msg, capsys):
    assert cli.main(["two-routers", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_spread_and_counter_deltas():
    assert spread([3, 5]) == 0.5 and spread([4, 4, 4]) == 0.0
    assert spread([7]) is None and spread([0, 0]) is None
    before = Snapshot({"finished": {"d0": 10, "d1": 2}, "tokens": {"d0": 100, "d1": 20}}, {"ra": 5, "rb": 0})
    after = Snapshot({"finished": {"d0": 14, "d1": 8}, "tokens": {"d0": 140, "d1": 80}}, {"ra": 8, "rb": 7})
    s = split_between(before, after)
    assert (s.finished, s.tokens, s.router_ok) == ({"d0": 4, "d1": 6}, {"d0": 40, "d1": 60}, {"ra": 3, "rb": 7})
    assert s.finished_spread == pytest.approx(0.4)
    assert s.plus(s).finished == {"d0": 8, "d1": 12}


def _result(i: int, ok: bool = True, tokens: int = 4, ttft: float = 0.1, error: str | None = None) -> RequestResult:
    return RequestResult(i, "main", ok, 10, 4, ttft_s=ttft, e2e_s=ttft + 0.3, output_tokens=tokens, error=error)


def test_a_failed_request_or_a_short_answer_counts_as_failed():
    bad = failed([_result(0), _result(1, tokens=3), _result(2, ok=False, error="HTTP 503: no decode worker")])
    assert [(r.index, r.error) for r in bad] == [(1, "3 tokens, asked 4"), (2, "HTTP 503: no decode worker")]


def test_every_phase_gets_the_same_prompts_behind_its_own_tag():
    specs = [RequestSpec(0, "river stone light", 3, 8), RequestSpec(1, "garden", 1, 8)]
    t = tagged(specs, 7, WordCounter())
    assert [(s.prompt, s.prompt_len, s.output_len) for s in t] == [("7: river stone light", 4, 8), ("7: garden", 2, 8)]


def _phase(name: str, duration: float, split: WorkerSplit) -> PhaseResult:
    results = [_result(i, ttft=0.1 * (i + 1)) for i in range(4)]
    cpu = {"router-a": 0.016, "router-b": 0.016 if name[0] == "B" else 0.0, "prefill-0": 0.1, "decode-0": 0.1}
    return PhaseResult(
        name,
        ["http://a"] if name[0] == "A" else ["http://a", "http://b"],
        compute_stats(results, duration),
        split,
        [],
        cpu,
    )


def test_summary_takes_medians_over_rounds_and_pools_b():
    even, uneven = (
        WorkerSplit({"d0": 2, "d1": 2}, {"d0": 8, "d1": 8}),
        WorkerSplit({"d0": 1, "d1": 3}, {"d0": 4, "d1": 12}),
    )
    phases = [_phase("A1", 1.0, even), _phase("B1", 2.0, uneven), _phase("A2", 2.0, even), _phase("B2", 1.0, even)]
    s = Summary.of(phases)
    assert s.median_a["tok/s"] == pytest.approx(12.0)  # 16 tokens in 1 s and in 2 s: median 12
    assert s.ratio["tok/s"] == pytest.approx(1.0) and s.ratio["TTFT p50 ms"] == pytest.approx(1.0)
    assert s.median_a["routers CPU ms/tok"] == pytest.approx(1.0)  # 16 ms over 16 tokens
    assert s.ratio["routers CPU ms/tok"] == pytest.approx(2.0) and s.median_b["workers CPU ms/tok"] == pytest.approx(
        12.5
    )
    assert s.pooled_b.finished == {"d0": 3, "d1": 5} and s.pooled_b.finished_spread == pytest.approx(0.5)
    assert "50.0% (NOT met)" in s.verdict()[1] and "(met at >= 0.95)" in s.verdict()[0]
    table = phases_table(phases, {"http://a": "router-a", "http://b": "router-b"})
    assert "| B1 | router-a+router-b | 4 | 0 | 8.0 |" in table and "1 / 3 | 100.0%" in table


def test_a_run_stopped_before_any_b_phase_says_so():
    s = Summary.of([_phase("A1", 1.0, WorkerSplit({"d0": 2, "d1": 2}, {"d0": 8, "d1": 8}))])
    assert s.ratio["tok/s"] is None and s.spread_lines("decode")[0] == "B (two routers): no phase ran to the end"
    assert "NOT met" in s.verdict()[0] and "NOT met" in s.verdict()[1]
