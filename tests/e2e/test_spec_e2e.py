"""Speculative decoding through launched servers (``--speculative-method ngram``), colocated and PD:
a request that repeats its prompt's passage has drafts accepted (the worker's series move), a stop
string landing inside accepted runs cuts the text where the full answer has it, a PD launch's
outputs equal those of a PD launch without it, and no KV page is left held."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, wait_idle
from tests.support.servers import PD_SERVER_FLAGS, PD_SERVER_HEARTBEAT_S

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2
PASSAGE = (
    "The lighthouse keeper climbed the stairs at dusk, lit the great lamp, and wrote in the log that the sea "
    "was calm, the wind was from the west, and no ships had passed since noon."
)


def test_spec_server_accepts_drafts_and_cuts_at_stop_strings(launched_server_per_test):
    srv = launched_server_per_test(
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


def test_spec_pd_decode_worker_accepts_drafts_with_the_plain_outputs(launched_server_per_test, pd_server):
    """A PD launch with ``--speculative-method ngram`` (real prefill and decode processes, NIXL KV
    transfer): the decode worker drafts from prompts whose KV came over the wire and has drafts
    accepted (its own series move; the prefill worker's stay at zero), and greedy and seeded outputs,
    each choice of an ``n = 3`` request too, equal those of the default PD launch without speculation."""
    srv = launched_server_per_test(
        "pd", *PD_SERVER_FLAGS, "--speculative-method", "ngram", "--num-speculative-tokens", "4"
    )
    url = srv.url
    before = wait_idle(url, PD_SERVER_HEARTBEAT_S)
    prompt = f"{PASSAGE}\n\nRepeat the passage above verbatim."
    bodies = [
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0},
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0.8, "seed": 5},
        # n > 1: the router's choices (seeds 5, 6, 7), the later ones sent once the first has a token
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0.8, "seed": 5, "n": 3},
    ]
    texts = {}
    for name, base in (("spec", url), ("plain", pd_server.url)):
        texts[name] = []
        for body in bodies:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            texts[name].append([c["message"]["content"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])])
    assert texts["spec"] == texts["plain"]
    assert "lamp" in texts["spec"][0][0], texts["spec"][0]
    assert len(texts["spec"][2]) == 3 and len(set(texts["spec"][2])) > 1, texts["spec"][2]  # seeded choices differ
    m = wait_idle(url, PD_SERVER_HEARTBEAT_S)

    def moved(name, worker):
        return metric_sum(m, name, worker=worker) - metric_sum(before, name, worker=worker)

    drafted = moved("pdserve_spec_draft_tokens_total", "decode-0")
    accepted = moved("pdserve_spec_accepted_tokens_total", "decode-0")
    assert 0 < accepted <= drafted
    assert moved("pdserve_spec_acceptance_length_sum", "decode-0") == accepted
    assert metric_sum(m, "pdserve_spec_draft_tokens_total", worker="prefill-0") == 0
