"""Two routers in front of the same workers, real parts: etcd started by the
test, two ``pdserve launch --roles router --discovery etcd://...`` processes, one prefill and two
decode ``pdserve worker`` processes on loopback, the tiny model, KV over NIXL.

A long request through router A is on one decode worker; a request through router B, which never
saw A's, goes to the other one (B routes by the load the workers report). Under a load split
over both routers no request fails, the routers' room tags differ (claimed in etcd), and the
decode workers' finished requests stay within 20 % of each other."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from bench.harness.subprocess_server import LaunchedServer, metric_sum, scrape_metrics
from server.discovery.etcd import EtcdClient
from tests.chaos.chaos_cluster import run_load
from tests.chaos.membership_load import SteadyLoad, WorkerProc, routed_tokens
from tests.chaos.tiny_model import save_tiny_model
from tests.support.etcd_server import INSTALL_HINT, EtcdServer, etcd_binary
from transfer.cluster_key import ClusterKey, write_key_file

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.skipif(etcd_binary() is None, reason=INSTALL_HINT)]

COMMON = [
    "--page-size",
    "16",
    "--kv-pool-tokens",
    "4096",
    "--max-model-len",
    "512",
    "--health-interval-s",
    "0.2",
    "--test-step-delay-s",
    "0.02",
    "--worker-timeout-s",
    "4",
    "--peer-timeout-s",
    "4",
    "--log-level",
    "WARNING",
]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-routers")
    etcd = EtcdServer(tmp / "etcd-data")
    etcd.start()
    write_key_file(tmp / "cluster.key", ClusterKey.generate())  # routers and workers share it
    common = [
        "--model",
        str(save_tiny_model(tmp / "model")),
        "--cluster-id",
        f"two-{os.getpid()}",
        "--cluster-key",
        str(tmp / "cluster.key"),
        "--discovery",
        f"etcd://127.0.0.1:{etcd.port}/two",
        *COMMON,
    ]
    routers = [LaunchedServer(["--mode", "pd", "--roles", "router", "--port", "0", *common]) for _ in range(2)]
    workers = {}
    try:
        for r in routers:
            r.start()
        for role, wid in (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")):
            workers[wid] = WorkerProc(role, wid, common)
        for r in routers:
            deadline = time.monotonic() + 240
            while httpx.get(f"{r.url}/health", timeout=5, trust_env=False).status_code != 200:
                assert time.monotonic() < deadline, httpx.get(f"{r.url}/health", trust_env=False).text
                time.sleep(0.3)
        yield etcd, routers, workers
    finally:
        for w in workers.values():
            w.stop()
        for r in routers:
            r.stop()
        etcd.kill()


def test_router_b_sees_router_a_requests_through_the_workers(parts):
    _, (a, b), _ = parts
    before = {d: routed_tokens(a.url, d) for d in ("decode-0", "decode-1")}
    long_a = threading.Thread(target=lambda: asyncio.run(run_load(a.url, [("a long one " * 5, 300)])))
    long_a.start()
    deadline = time.monotonic() + 30
    while all(routed_tokens(a.url, d) == before[d] for d in before):  # A's request reached a decode worker
        assert time.monotonic() < deadline
        time.sleep(0.1)
    busy = next(d for d in before if routed_tokens(a.url, d) > before[d])
    time.sleep(1.0)  # a few heartbeats: B's view of the workers includes A's request
    mid = {d: routed_tokens(b.url, d) for d in before}
    outcome = asyncio.run(run_load(b.url, [("a short one", 8)]))[0]
    assert outcome.status == 200 and not outcome.error, (outcome.status, outcome.error)
    deadline = time.monotonic() + 10
    while not (got := [d for d in before if routed_tokens(b.url, d) > mid[d]]):  # B sees it a heartbeat later
        assert time.monotonic() < deadline, "router B never saw its own request's prompt tokens on a worker"
        time.sleep(0.1)
    long_a.join(120)
    assert got and busy not in got, (busy, got)


def test_load_split_over_two_routers_fails_nothing_and_spreads_evenly(parts):
    etcd, routers, _ = parts
    tags = EtcdClient(etcd.url).get_prefix("/two/routers/")[1]
    assert len(tags) == 2  # each router claimed its own room tag
    m0 = scrape_metrics(routers[0].url)
    before = {d: metric_sum(m0, "pdserve_worker_finished_requests_total", worker=d) for d in ("decode-0", "decode-1")}
    loads = [SteadyLoad(r.url, clients=4, max_tokens=24).start() for r in routers]
    time.sleep(15)
    for load in loads:
        load.stop()
    assert [load.failed() for load in loads] == [[], []]
    time.sleep(1)
    m = scrape_metrics(routers[1].url)
    done = {d: metric_sum(m, "pdserve_worker_finished_requests_total", worker=d) - before[d] for d in before}
    total = sum(len(load.outcomes) for load in loads)
    spread = abs(done["decode-0"] - done["decode-1"]) / (sum(done.values()) / 2)
    print(f"\ntwo routers, 4 streams each: {total} requests, per decode worker {done}, spread {spread:.0%}")
    assert sum(done.values()) >= total and spread <= 0.2
