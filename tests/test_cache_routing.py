"""Cache-aware routing in-process: the documented cost picks the pair that holds the prompt, the
cap spills a hot prefix, no cache means least loaded; decisions and the index move the router's
metrics; a real worker feed (ZMQ PUB, plain and CURVE) keeps a subscriber's index equal to the
tree through a lost message."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache.kv_events import tree_hashes
from cache.page_hash import page_hashes
from cache.radix_cache import RadixCache
from server.router.cache_routing import CacheAwarePolicy
from server.router.kv_index import KvIndex
from server.router.kv_metrics import KvIndexCollector
from server.router.kv_subscriber import KvSubscriber
from server.router.metrics import RouterMetrics
from server.router.registry import READY, WorkerHandle, WorkerSpec, route_pd
from server.worker.kv_feed import KvFeed
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import WorkerStats

PS = 4
PROMPT = list(range(100, 141))  # 41 tokens: 10 whole pages of the first 40


def _handle(wid: str, role: str, addr: str = "tcp://127.0.0.1:1", **stats) -> WorkerHandle:
    h = WorkerHandle(WorkerSpec(wid, role, addr), client=None, state=READY)
    h.stats = WorkerStats(worker_id=wid, role=role, model="m", capacity_tokens=1000, max_model_len=512,
                          page_size=PS, **stats)
    return h


def _pd(index: KvIndex, metrics: RouterMetrics | None = None, slack: int = 4):
    handles = [_handle(w, "prefill" if w[0] == "p" else "decode") for w in ("p0", "p1", "d0", "d1")]
    policy = CacheAwarePolicy(index, balance_slack=slack, on_decision=metrics.observe_routing if metrics else None)
    return handles, policy


def _holds(index: KvIndex, wid: str, n_pages: int, tokens=PROMPT) -> None:
    index.apply_snapshot(wid, "i", 1, page_hashes(tokens, PS)[:n_pages])


def _load(q: dict[str, int]):
    return lambda wid: (q.get(wid, 0), 0.0, 0)


def _decisions(metrics: RouterMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        if fam.name == "pdserve_routing_decisions":
            out |= {s.labels["reason"]: s.value for s in fam.samples if s.name.endswith("_total")}
    return out


def _ids(route) -> list[str]:
    return [h.worker_id for h in route.targets]


def test_the_pair_holding_the_prompt_wins_and_counts_as_prefix():
    index, metrics = KvIndex(), RouterMetrics(lambda: [], lambda: 0)
    handles, policy = _pd(index, metrics)
    _holds(index, "p1", 10)
    _holds(index, "d0", 6)
    _holds(index, "d1", 3)
    assert _ids(policy(handles, _load({}), PROMPT)) == ["p1", "d0"]
    assert _decisions(metrics) == {"prefix": 1.0}


def test_load_outweighs_a_hit_past_two_requests_and_the_cap_spills():
    index = KvIndex()
    handles, policy = _pd(index, slack=4)
    _holds(index, "p1", 10)  # the whole prompt but its last token: cost 1 + 0.5 * 41 * q
    assert _ids(policy(handles, _load({"p1": 1}), PROMPT))[0] == "p1"  # 21.5 < 41
    assert _ids(policy(handles, _load({"p1": 2}), PROMPT))[0] == "p0"  # 42 > 41
    metrics = RouterMetrics(lambda: [], lambda: 0)
    handles, policy = _pd(index, metrics, slack=0)
    assert _ids(policy(handles, _load({"p1": 1}), PROMPT))[0] == "p0"  # cheapest, but over the cap
    assert _decisions(metrics) == {"cap": 1.0}


def test_without_any_cache_it_is_least_loaded():
    index, metrics = KvIndex(), RouterMetrics(lambda: [], lambda: 0)
    handles, policy = _pd(index, metrics)
    for q in ({}, {"p0": 1, "d0": 2}, {"p1": 3, "d1": 1}):
        assert _ids(policy(handles, _load(q), PROMPT)) == _ids(route_pd(handles, _load(q)))
    assert _decisions(metrics) == {"load": 3.0}


def test_colocated_replicas_use_the_same_index():
    index = KvIndex()
    handles = [_handle("w0", "colocated"), _handle("w1", "colocated")]
    _holds(index, "w1", 5)
    assert _ids(CacheAwarePolicy(index)(handles, _load({}), PROMPT)) == ["w1"]
    _holds(index, "w1", 5, tokens=[7] + PROMPT[1:])  # another first token: no shared page
    assert _ids(CacheAwarePolicy(index)(handles, _load({}), PROMPT)) == ["w0"]


class _Client:
    def __init__(self, feed: KvFeed) -> None:
        self.feed, self.asked = feed, []

    def request_kv_snapshot(self, reason: str) -> None:
        self.asked.append(reason)
        self.feed.snapshot()


async def _until(cond, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


def _series(metrics: RouterMetrics, name: str) -> dict[tuple, float]:
    text = metrics.render()
    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text.decode())
            for s in fam.samples if s.name == name}


@pytest.mark.parametrize("secure", [False, True])
def test_a_worker_feed_keeps_the_index_equal_to_its_tree_through_a_lost_message(secure):
    auth = ControlAuth(ClusterKey.generate()) if secure else ControlAuth.insecure()
    tree = RadixCache(PS)
    feed = KvFeed(tree, "tcp://127.0.0.1:9", "p0", "inst-1", auth)
    h = _handle("p0", "prefill", kv_events_port=feed.port, instance="inst-1")
    h.client = _Client(feed)
    index = KvIndex()
    sub = KvSubscriber(index, lambda: {"p0": h}, auth, resync_s=0.2, tick_s=0.05)
    metrics = RouterMetrics(lambda: [h], lambda: 0)
    metrics.registry.register(KvIndexCollector(sub))

    def same() -> bool:
        return not index.needs_snapshot("p0") and index.held("p0") == frozenset(tree_hashes(tree))

    async def scenario():
        task = asyncio.create_task(sub.run())
        try:
            tree.insert(PROMPT[:8], [0, 1])
            await _until(lambda: not index.needs_snapshot("p0"))  # the first snapshot, asked at once
            tree.insert(PROMPT[:16], [0, 1, 2, 3])
            feed.flush()
            await _until(same)
            assert index.cached_pages("p0", page_hashes(PROMPT, PS)) == 4
            feed.seq += 1  # a message lost on the way: the next one shows the gap
            tree.evict(10)
            feed.flush()
            await _until(lambda: same() and h.client.asked[-1] == "gap")
            assert index.size("p0") == 0 and h.client.asked.count("gap") == 1
            # the worker restarts: a new process (instance), a new feed port, a cache of its own
            tree.insert(PROMPT[:8], [0, 1])
            feed.flush()
            await _until(lambda: same() and index.size("p0") == 2)
            new_tree = RadixCache(PS)
            new_tree.insert(PROMPT[4:12], [5, 6])
            restarted.append(KvFeed(new_tree, "tcp://127.0.0.1:9", "p0", "inst-2", auth))
            h.client.feed = restarted[0]
            h.stats = h.stats.model_copy(update={"instance": "inst-2", "kv_events_port": restarted[0].port})
            await _until(lambda: not index.needs_snapshot("p0") and index.held("p0") == frozenset(tree_hashes(new_tree)))
            assert h.client.asked[-1] == "restart" and index.cached_pages("p0", page_hashes(PROMPT, PS)) == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    restarted: list[KvFeed] = []
    try:
        asyncio.run(scenario())
    finally:
        for f in (feed, *restarted):
            f.close()
    initial = h.client.asked.count("initial")  # one, or more when a snapshot beat the connection
    restarts = h.client.asked.count("restart")  # one, or more when the new feed's first snapshot was early
    assert _series(metrics, "pdserve_router_kv_resyncs_total") == {
        (("cause", "gap"),): 1.0, (("cause", "initial"),): float(initial), (("cause", "restart"),): float(restarts)}
    assert 3 <= _series(metrics, "pdserve_router_kv_snapshots_total")[()] <= 1 + initial + restarts
    assert _series(metrics, "pdserve_router_kv_events_total") == {(): 2.0}  # the flush after the gap is not applied
    assert _series(metrics, "pdserve_router_kv_index_pages") == {(("worker", "p0"),): 2.0}


def test_a_router_without_the_cluster_key_gets_nothing_from_a_curve_feed():
    tree = RadixCache(PS)
    feed = KvFeed(tree, "tcp://127.0.0.1:9", "p0", "inst-1", ControlAuth(ClusterKey.generate()))
    h = _handle("p0", "prefill", kv_events_port=feed.port, instance="inst-1")
    h.client = _Client(feed)
    index = KvIndex()
    sub = KvSubscriber(index, lambda: {"p0": h}, ControlAuth(ClusterKey.generate()), resync_s=0.1, tick_s=0.05)

    async def scenario():
        task = asyncio.create_task(sub.run())
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        tree.insert(PROMPT[:8], [0, 1])
        asyncio.run(scenario())
    finally:
        feed.close()
    assert h.client.asked and index.needs_snapshot("p0") and index.counters.snapshots == 0
