"""Unit tests of ``bench.compose_multiturn``'s pieces that need no Docker: the override it gives the
compose project, how it reads the router's worker listing, and the ratios it prints."""

from __future__ import annotations

import pytest
import yaml

from bench.compose_multiturn import DEFAULT_MT, build_parser, compare, override, ready_counts, summary
from configs.schema import env_overrides

pytestmark = pytest.mark.unit


def test_override_sets_the_policy_and_pool_on_every_service():
    doc = yaml.safe_load(override("cache-aware", 32768, 256))
    assert set(doc["services"]) == {"prefill", "decode", "router", "router-b"}
    for env in (s["environment"] for s in doc["services"].values()):
        assert env == {
            "PDSERVE_ROUTING": "cache-aware",
            "PDSERVE_KV_POOL_TOKENS": "32768",
            "PDSERVE_LOCAL_PREFILL_MAX_TOKENS": "256",
        }
        nested = env_overrides(env)  # every variable names a config field the services read
        assert sum(len(v) for v in nested.values()) == 3
    env = yaml.safe_load(override("least-loaded", 4096, 0, "bfloat16"))["services"]["decode"]["environment"]
    assert env_overrides(env)["engine"]["dtype"] == "bfloat16" and env["PDSERVE_ROUTING"] == "least-loaded"


def test_ready_counts_reads_the_health_listing():
    text = (
        "prefill-a1 (prefill): ready; prefill-b2 (prefill): ready; decode-c3 (decode): ready; "
        "decode-d4 (decode): starting"
    )
    assert ready_counts(text) == (2, 1)


def _payload(ttft_mean: float, ttft_p99: float, tok_s: float) -> dict:
    stats = {"ttft": {"mean_ms": ttft_mean, "p99_ms": ttft_p99}, "output_throughput": tok_s, "failed": 0}
    return {"runs": [{"kind": "all", "stats": stats}, {"kind": "turn2", "stats": {**stats, "ttft": None}}]}


def test_compare_is_other_over_base():
    rows = compare(summary(_payload(800, 2000, 100)), summary(_payload(400, 500, 120)))
    assert rows == [("all", "0.50x", "0.25x", "1.20x"), ("turn2", "-", "-", "1.20x")]


def test_multi_turn_flags_pass_through():
    a = build_parser().parse_args(["--routings", "least-loaded,cache-aware", "--", "--users", "4"])
    assert a.mt_args == ["--", "--users", "4"] and a.routings.split(",") == ["least-loaded", "cache-aware"]
    assert build_parser().parse_args([]).mt_args == [] and "--users" in DEFAULT_MT
