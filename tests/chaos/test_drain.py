"""Graceful drain on a launched PD cluster (router, 2 prefill and 2 decode
workers, real processes on loopback, the tiny random model, KV over NIXL), under a load of
concurrent streams: a worker drained through the router's ``POST /admin/drain`` and one drained by
SIGTERM each fail no request, exit 0, and stay down (the launcher does not restart a drained
worker); the router keeps serving on the others, and no KV page stays used."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import pytest

from tests.chaos.chaos_cluster import Cluster, leaks, run_load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

ARGS = [
    "--kv-pool-tokens",
    "2048",
    "--page-size",
    "16",
    "--max-model-len",
    "512",
    "--test-step-delay-s",
    "0.03",
    "--chunked-prefill-size",
    "8",
    "--worker-timeout-s",
    "4",
    "--peer-timeout-s",
    "4",
    "--drain-timeout-s",
    "60",
    "--local-prefill-backlog-ratio",
    "0",  # prompts stay on the prefill workers (a decode worker would take queued ones off them)
]
PROMPTS = [(f"drain test prompt number {i} " + "river stone light " * (i % 5 + 1), 40) for i in range(16)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(save_tiny_model(tmp_path_factory.mktemp("drain-model")), prefill=2, decode=2, args=ARGS)
    c.start()
    yield c
    c.stop()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5, trust_env=False).json()


def _wait_state(url: str, worker_id: str, state: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = _health(url)["workers"]
        mine = [w for w in workers.split("; ") if w.startswith(f"{worker_id} ")]
        if mine and f": {state}" in mine[0]:
            return mine[0]
        time.sleep(0.2)
    raise TimeoutError(f"{worker_id} not {state} after {timeout_s}s: {workers}")


def _drain_under_load(cluster: Cluster, worker_id: str, how, after_s: float) -> tuple[list, int]:
    """Start the load, drain ``worker_id`` with ``how(pid)`` ``after_s`` later, return the outcomes
    and the drained process's pid (gone by then)."""
    pid = cluster.pid(worker_id)

    async def go():
        load = asyncio.create_task(run_load(cluster.url, PROMPTS))
        await asyncio.sleep(after_s)
        await asyncio.to_thread(how, pid)
        return await load

    outcomes = asyncio.run(go())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the launcher reaps it; /proc/PID goes away
        if not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.2)
    return outcomes, pid


def _check_all_served(outcomes) -> None:
    failed = [(o.prompt, o.status, o.error) for o in outcomes if o.status != 200 or o.error or len(o.tokens) != 40]
    assert failed == [], failed


def test_admin_drain_under_load_fails_no_request(cluster):
    def drain(_pid):
        r = httpx.post(f"{cluster.url}/admin/drain", json={"worker_id": "decode-0"}, timeout=5, trust_env=False)
        assert r.status_code == 202, r.text
        assert r.json()["state"] == "draining" and r.json()["in_flight"] > 0

    outcomes, pid = _drain_under_load(cluster, "decode-0", drain, after_s=1.5)  # every stream decoding
    _check_all_served(outcomes)
    line = _wait_state(cluster.url, "decode-0", "drained")
    assert "exited 0 after a drain" in line
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(LookupError):  # not restarted
        cluster.pid("decode-0")
    after = asyncio.run(run_load(cluster.url, PROMPTS[:4]))
    _check_all_served(after)
    assert httpx.get(f"{cluster.url}/health", timeout=5, trust_env=False).status_code == 200  # drained on purpose


def test_sigterm_drains_a_prefill_worker_under_load(cluster):
    def sigterm_once_it_holds_work(pid: int) -> None:
        deadline = time.monotonic() + 30
        while cluster.counter("pdserve_router_outstanding_tokens", worker="prefill-0") == 0:
            assert time.monotonic() < deadline, "the router sent prefill-0 nothing"
            time.sleep(0.02)
        os.kill(pid, signal.SIGTERM)

    outcomes, pid = _drain_under_load(cluster, "prefill-0", sigterm_once_it_holds_work, after_s=0.0)
    _check_all_served(outcomes)
    held = re.findall(r"worker prefill-0 is draining \((\d+) request", cluster.server.log())
    assert held and int(held[0]) > 0, f"prefill-0 held nothing when it drained: {held}"  # the test tests a drain
    _wait_state(cluster.url, "prefill-0", "drained")
    with pytest.raises(LookupError):
        cluster.pid("prefill-0")
    _check_all_served(asyncio.run(run_load(cluster.url, PROMPTS[:4])))
    deadline = time.monotonic() + 30
    while leaks(cluster.metrics()) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.5)
    m = cluster.metrics()
    assert leaks(m) == (0, 0), {k: v for k, v in m.items() if k[0] == "pdserve_kv_pool_pages" and v}


def test_drain_errors_name_what_to_change(cluster):
    r = httpx.post(f"{cluster.url}/admin/drain", json={"worker_id": "decode-9"}, timeout=5, trust_env=False)
    assert r.status_code == 404 and "known workers: decode-0, decode-1" in r.json()["error"]["message"]
    r = httpx.post(f"{cluster.url}/admin/drain", json={"worker": "decode-1"}, timeout=5, trust_env=False)
    assert r.status_code == 400 and "worker_id" in r.json()["error"]["message"]
    r = httpx.post(f"{cluster.url}/admin/drain", json={"worker_id": "decode-0"}, timeout=5, trust_env=False)
    assert r.status_code == 409 and "decode-0 is drained" in r.json()["error"]["message"]
