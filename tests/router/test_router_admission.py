"""The admission stage through HTTP (FastAPI TestClient, scripted fake workers, no model): 429 with
OpenAI's error shape and Retry-After before any worker is touched, 504 for a request whose
``timeout`` runs out while queued, a queued request forwarded when a slot frees, the request
fields ``priority`` / ``timeout``, several API keys, and the admission series moving by the
expected amounts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fake_worker import completion

pytestmark = pytest.mark.unit


def scrape(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def val(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def wait_until(pred, what: str, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def test_full_router_answers_429_with_retry_after_and_never_touches_a_worker(make_client):
    client, worker, ctx = make_client({"hang": True}, max_inflight_per_worker=1, max_queued_requests=0)
    holder, out = in_thread(lambda: completion(client, timeout=1.0))
    wait_until(lambda: len(worker.requests) == 1, "the first request reached the worker")
    before = scrape(client)
    r = completion(client)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert "max_queued_requests=0" in err["message"] and "retry later" in err["message"]
    assert r.headers["Retry-After"] == "1" and r.headers["retry-after-ms"] == "1000"  # no drain rate yet
    assert len(worker.requests) == 1
    after = scrape(client)
    assert (
        val(after, "pdserve_shed_requests_total", reason="queue_full")
        - val(before, "pdserve_shed_requests_total", reason="queue_full")
        == 1
    )
    assert val(after, "pdserve_requests_total", status="429") - val(before, "pdserve_requests_total", status="429") == 1
    router = client.get("/dashboard/data").json()["router"]  # the dashboard shows the same numbers
    assert router["shed"]["queue_full"] == val(after, "pdserve_shed_requests_total", reason="queue_full")
    assert router["queued"] == {"default": [0, 0]}
    assert sum(router["queue_wait"]["counts"]) == val(after, "pdserve_queue_wait_seconds_count") == 1
    holder.join(30)
    assert out[0].status_code == 504 and ctx.admission.inflight_slots == 0 and len(ctx.table) == 0


def test_queued_request_goes_when_a_slot_frees_or_times_out_in_the_queue(make_client):
    client, worker, ctx = make_client({"hang": True}, max_inflight_per_worker=1)
    m0 = scrape(client)
    first, out1 = in_thread(lambda: completion(client, timeout=1.0))
    wait_until(lambda: len(worker.requests) == 1, "the first request reached the worker")
    second, out2 = in_thread(lambda: completion(client, timeout=2.5, priority=-3))
    wait_until(lambda: ctx.admission.queued_requests == 1, "the second request is queued")
    m1 = scrape(client)
    assert val(m1, "pdserve_queued_requests", key="default") == 1
    assert val(m1, "pdserve_queued_tokens", key="default") == len(worker.requests[0][1]) + 16
    assert val(m1, "pdserve_router_outstanding_tokens", worker="w0") == len(worker.requests[0][1]) + 16
    # a third one whose timeout runs out while it waits behind the second: 504, never forwarded
    r = completion(client, timeout=0.2)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline"
    assert "router's queue" in r.json()["error"]["message"]
    first.join(30)
    assert out1[0].status_code == 504 and out1[0].json()["error"]["code"] == "timeout"  # ran out on the worker
    wait_until(lambda: len(worker.requests) == 2, "the queued request went to the worker once the slot freed")
    second.join(30)
    assert out2[0].status_code == 504 and out2[0].json()["error"]["code"] == "timeout"
    assert sorted(worker.aborted) == sorted(rid for rid, _, _ in worker.requests)  # both aborted on the worker
    m2 = scrape(client)
    assert (
        val(m2, "pdserve_shed_requests_total", reason="deadline")
        - val(m0, "pdserve_shed_requests_total", reason="deadline")
        == 1
    )
    assert val(m2, "pdserve_queue_wait_seconds_count") - val(m0, "pdserve_queue_wait_seconds_count") == 2
    assert val(m2, "pdserve_queue_wait_seconds_sum") > val(m0, "pdserve_queue_wait_seconds_sum")  # one waited
    assert val(m2, "pdserve_queued_requests", key="default") == 0
    assert val(m2, "pdserve_router_outstanding_tokens", worker="w0") == 0
    assert ctx.admission.inflight_slots == 0 and len(ctx.table) == 0


def test_request_timeout_field_caps_the_run(make_client):
    client, worker, ctx = make_client({"hang": True}, request_timeout_s=60)
    r = completion(client, timeout=0.2)
    assert r.status_code == 504 and "0.2s" in r.json()["error"]["message"] and len(worker.aborted) == 1


@pytest.mark.parametrize(
    "body,param",
    [
        ({"priority": "high"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": "5"}, "timeout"),
    ],
)
def test_bad_priority_or_timeout_is_a_400_naming_it(make_client, body, param):
    client, worker, _ = make_client()
    r = completion(client, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and worker.requests == []


def test_several_api_keys_each_get_a_queue_series(make_client):
    client, _, _ = make_client(api_key="alpha:3,beta")
    assert completion(client, {"Authorization": "Bearer alpha"}).status_code == 200
    assert completion(client, {"Authorization": "Bearer beta"}).status_code == 200
    assert completion(client, {"Authorization": "Bearer alpha:3"}).status_code == 401
    m = scrape(client)
    assert val(m, "pdserve_queued_requests", key="key-0") == 0 and ("pdserve_queued_requests", (("key", "key-1"),)) in m
    assert not any("alpha" in str(k) or "beta" in str(k) for k in m)  # secrets never exported


class GoneRequest:
    """A starlette ``Request`` stand-in whose client has already disconnected."""

    class state:  # noqa: N801 (mirrors ``Request.state``)
        api_key_name = "default"

    async def is_disconnected(self) -> bool:
        return True


def test_client_gone_while_queued_is_counted_and_leaves_the_queue(make_client):
    from server.router.admission import Demand
    from server.router.http_util import ClientGone
    from server.router.serving import admit

    client, worker, ctx = make_client(max_inflight_per_worker=1)
    held = ctx.admission.try_grant(Demand("default", 0, 1, 10, time.monotonic() + 60))
    m0 = scrape(client)

    async def queued_then_gone():
        await admit(ctx, GoneRequest(), Demand("default", 0, 1, 10, time.monotonic() + 60))

    with pytest.raises(ClientGone):
        asyncio.run(queued_then_gone())
    m1 = scrape(client)
    assert (
        val(m1, "pdserve_shed_requests_total", reason="client_gone")
        - val(m0, "pdserve_shed_requests_total", reason="client_gone")
        == 1
    )
    assert ctx.admission.queued_requests == 0 and ctx.admission.inflight_slots == 1 and worker.requests == []
    ctx.admission.release(held)
    assert ctx.admission.inflight_slots == 0


def test_a_certain_429_goes_out_before_the_body_is_validated_or_tokenized(make_client, monkeypatch):
    """The fast 429: with the worker full and the queue at its bound, completions and chat requests
    are refused from the key and ``priority`` alone (tokenizer never called, nothing forwarded,
    each refusal counted once); a body that is not JSON is still a 400, and one whose ``priority``
    is not an integer is left to validation (400)."""
    client, worker, ctx = make_client({"hang": True}, max_inflight_per_worker=1, max_queued_requests=0)
    holder, out = in_thread(lambda: completion(client, timeout=1.0))
    wait_until(lambda: len(worker.requests) == 1, "the first request reached the worker")
    calls: list = []
    real = ctx.tokenizer.encode
    monkeypatch.setattr(ctx.tokenizer, "encode", lambda *a, **k: calls.append(a) or real(*a, **k))
    before = scrape(client)
    refused = [
        completion(client, priority=5),
        completion(client, bogus_field=1),
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ]
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert r.headers["retry-after-ms"] == "1000" and r.headers["Retry-After"] == "1"
    assert calls == [] and len(worker.requests) == 1
    after = scrape(client)
    assert (
        val(after, "pdserve_shed_requests_total", reason="queue_full")
        - val(before, "pdserve_shed_requests_total", reason="queue_full")
        == 3
    )
    assert val(after, "pdserve_requests_total", status="429") - val(before, "pdserve_requests_total", status="429") == 3
    bad_json = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    bad_priority = completion(client, priority="high")
    assert bad_priority.status_code == 400 and "priority" in bad_priority.text
    holder.join(30)
    assert out[0].status_code == 504 and ctx.admission.inflight_slots == 0
