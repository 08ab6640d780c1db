"""Smoke runs of the security micro-benchmarks (tiny sizes; the figures are not checked, only that
every configuration was measured and the seal round-trips inside the benchmark)."""

from __future__ import annotations

from benchmarks import curve_cost, notif_seal_cost


def test_curve_cost_measures_both_configurations_for_both_messages(capsys):
    rows = curve_cost.measure(repeat=2, rtt_batch=5, burst=20, prompt_tokens=16)
    assert [(r["message"], r["metric"]) for r in rows] == [
        ("GenerateRequest", "round trip (us)"),
        ("GenerateRequest", "one-way (msg/s)"),
        ("heartbeat (StatsRequest)", "round trip (us)"),
        ("heartbeat (StatsRequest)", "one-way (msg/s)"),
    ]
    assert rows[0]["bytes"] > rows[2]["bytes"]  # the prompt frame makes the request the larger message
    assert all(v > 0 for r in rows for k in ("plain", "curve") for v in r[k])
    assert "ratio" in curve_cost.report(rows).splitlines()[0]


def test_notif_seal_cost_times_every_step():
    rows = notif_seal_cost.measure(n=5, repeat=2, prompt_logprobs=4)
    steps = {step for _, _, step, _, _ in rows}
    assert {"HMAC seal (sender)", "HMAC open (receiver)", "CRC verify (receiver, today)"} <= steps
    assert len(rows) == 10 and all(best > 0 and med >= best for *_, best, med in rows)
