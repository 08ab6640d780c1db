"""Schemathesis against the router's own OpenAPI document (a real launched colocated server): every
generated request, valid or not, streaming or not, is answered 2xx/4xx, never 5xx (but 504 for a request
whose own ``timeout`` ran out), and the server
stays up and leaks no KV. The pool and context are small so valid requests stay short."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from bench.harness.subprocess_server import wait_idle

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def server(launched_server):
    return launched_server(
        "colocated",
        "--kv-pool-tokens",
        "1024",
        "--max-model-len",
        "128",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--request-timeout-s",
        "300",
        "--log-level",
        "WARNING",
    )


def operation(url: str, path: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return next(r.ok() for r in schema.get_all_operations() if r.ok().path == path)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_routes_never_answer_5xx(server, path):
    # schemathesis's pytest plugin does not load under this pytest; its strategies drive hypothesis directly
    @given(case=operation(server.url, path).as_strategy())
    @settings(
        max_examples=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )  # no shrinking: each example is a real generation
    def check(case):
        r = case.call(base_url=server.url, timeout=300)
        # a 504 is the right answer when the request asked for a deadline (``timeout``) it could not meet
        asked_deadline = isinstance(case.body, dict) and case.body.get("timeout") is not None
        assert r.status_code < 500 or (r.status_code == 504 and asked_deadline), (
            f"{case.method} {case.path} {case.body!r} -> {r.status_code} {r.text[:500]}"
        )
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and set(err) == {"message", "type", "param", "code"}

    check()


def test_server_survived_and_leaked_nothing(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    m = wait_idle(server.url, HEARTBEAT_S, timeout_s=60)
    used = sum(v for (n, lab), v in m.items() if n == "pdserve_kv_pool_pages" and dict(lab).get("state") == "used")
    assert used == 0


def test_openapi_document_states_the_bodies(server):
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/CompletionRequest")
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
