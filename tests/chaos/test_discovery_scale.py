"""Membership that grows and shrinks with real parts: etcd started by the test, a router
(``pdserve launch --roles router --discovery etcd://...``) and ``pdserve worker`` processes on
loopback, the tiny random model, KV over NIXL, a steady streamed load throughout.

1P+1D -> 2P+2D -> 1P+1D: the new workers register and get requests without touching the router;
the first ones are drained by SIGTERM (they leave etcd, finish what they hold, exit 0). Zero failed
requests, the same router process; the time from a worker's start to its first routed request is
printed. Then etcd is killed: the router keeps routing on the last membership and ``/health`` says
etcd is unavailable; etcd restarts and the router watches again with the same workers."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from bench.harness.subprocess_server import LaunchedServer
from server.discovery.etcd import EtcdClient
from tests.chaos.membership_load import SteadyLoad, WorkerProc, first_routed_after_start
from tests.chaos.tiny_model import save_tiny_model
from tests.support.etcd_server import INSTALL_HINT, EtcdServer, etcd_binary
from transfer.cluster_key import ClusterKey, write_key_file

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.skipif(etcd_binary() is None, reason=INSTALL_HINT)]

COMMON = [
    "--page-size",
    "16",
    "--kv-pool-tokens",
    "2048",
    "--max-model-len",
    "512",
    "--health-interval-s",
    "0.2",
    "--test-step-delay-s",
    "0.01",
    "--worker-timeout-s",
    "4",
    "--peer-timeout-s",
    "4",
    "--log-level",
    "WARNING",
    "--drain-timeout-s",
    "60",
    "--discovery-lease-s",
    "3",
]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    etcd = EtcdServer(tmp / "etcd-data")
    etcd.start()
    write_key_file(tmp / "cluster.key", ClusterKey.generate())  # the router and workers share it
    common = [
        "--model",
        str(save_tiny_model(tmp / "model")),
        "--cluster-id",
        f"scale-{os.getpid()}",
        "--cluster-key",
        str(tmp / "cluster.key"),
        "--discovery",
        f"etcd://127.0.0.1:{etcd.port}/scale",
        *COMMON,
    ]
    router = LaunchedServer(["--mode", "pd", "--roles", "router", "--port", "0", *common])
    workers: dict[str, WorkerProc] = {}
    try:
        router.start()
        yield etcd, router, workers, common
    finally:
        for w in workers.values():
            w.stop()
        router.stop()
        etcd.kill()


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5, trust_env=False).json()


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def _start(workers: dict, common: list[str], role: str, wid: str) -> WorkerProc:
    workers[wid] = WorkerProc(role, wid, common)
    return workers[wid]


def test_scale_up_and_down_under_load_fails_no_request(parts):
    etcd, router, workers, common = parts
    url = router.url
    assert _health(url)["workers"].startswith("no worker registered")
    for role, wid in (("prefill", "prefill-a"), ("decode", "decode-a")):
        _start(workers, common, role, wid)
    _wait(lambda: httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200, 180, "1P+1D ready")
    load = SteadyLoad(url).start()
    time.sleep(2)
    joined = [_start(workers, common, "prefill", "prefill-b"), _start(workers, common, "decode", "decode-b")]
    etcd_client = EtcdClient(etcd.url)
    keys = lambda: etcd_client.get_prefix("/scale/workers/")[1]  # noqa: E731
    join_s = {
        w.worker_id: first_routed_after_start(url, w, lambda w=w: f"/scale/workers/{w.worker_id}" in keys())
        for w in joined
    }
    time.sleep(2)  # 2P+2D under load
    for wid in ("prefill-a", "decode-a"):
        workers[wid].proc.send_signal(signal.SIGTERM)
    for wid in ("prefill-a", "decode-a"):
        assert workers[wid].proc.wait(90) == 0, workers[wid].output()[-3000:]
    _wait(lambda: "-a " not in _health(url)["workers"], 30, "drained workers removed")
    time.sleep(2)  # 1P+1D (the new ones) under load
    outcomes = load.stop()
    print(
        f"\nscale 1P+1D -> 2P+2D -> 1P+1D: {len(outcomes)} requests, {len(load.failed())} failed; "
        f"worker start -> registered in etcd -> first routed request: "
        + ", ".join(f"{w} {r:.1f}s -> {s:.1f}s" for w, (r, s) in join_s.items())
    )
    assert load.failed() == []
    assert len(outcomes) > 20
    assert router.proc.poll() is None  # the same router all along
    health = _health(url)
    assert health["status"] == "ok" and "prefill-b (prefill): ready" in health["workers"]
    assert "decode-b (decode): ready" in health["workers"] and "watching, 2 worker(s)" in health["discovery"]


def test_router_keeps_its_membership_while_etcd_is_down(parts):
    etcd, router, workers, common = parts
    url = router.url
    etcd.kill()
    _wait(lambda: "unavailable since" in _health(url).get("discovery", ""), 20, "outage in /health")
    load = SteadyLoad(url, clients=2).start()
    time.sleep(4)  # longer than the workers' lease: etcd is down, so nothing expires
    load.stop()
    assert load.failed() == [] and load.outcomes
    assert "keeping the last membership (2 worker(s))" in _health(url)["discovery"]
    etcd.start()
    _wait(lambda: "watching, 2 worker(s)" in _health(url).get("discovery", ""), 30, "watch resumed")
    assert httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200
