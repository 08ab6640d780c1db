"""Speculative decoding through a launched colocated server (``--speculative-method ngram``): a
request that repeats its prompt's passage has drafts accepted (the worker's series move), a stop
string landing inside accepted runs cuts the text where the full answer has it, and no KV page is
left held."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, wait_idle

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2
PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the great lamp, and wrote in the log that the sea "
    "was calm, the wind was from the west, and no ships had passed since noon."
)


def test_spec_server_accepts_drafts_and_cuts_at_stop_strings(launched_server):
    srv = launched_server(
        "colocated",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "4",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--log-level",
        "WARNING",
    )
    url = srv.url
    before = wait_idle(url, HEARTBEAT_S)
    body = {
        "messages": [{"role": "user", "content": f"{PASSAGE}\n\nRepeat the passage above verbatim."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    full = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert full.status_code == 200, full.text
    text = full.json()["choices"][0]["message"]["content"]
    assert "lamp" in text, text  # the model does repeat the passage
    m = wait_idle(url, HEARTBEAT_S)
    drafted = metric_sum(m, "pdserve_spec_draft_tokens_total") - metric_sum(before, "pdserve_spec_draft_tokens_total")
    accepted = metric_sum(m, "pdserve_spec_accepted_tokens_total") - metric_sum(
        before, "pdserve_spec_accepted_tokens_total"
    )
    assert 0 < accepted <= drafted
    cut = httpx.post(f"{url}/v1/chat/completions", json={**body, "stop": ["lamp"]}, timeout=300)
    assert cut.status_code == 200, cut.text
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index("lamp")]
    wait_idle(url, HEARTBEAT_S)  # nothing queued, running or holding a page
