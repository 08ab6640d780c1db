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
from server.router.inflight import InflightTable
from server.router.kv_index import KvIndex
from server.router.kv_metrics import KvIndexCollector
from server.router.kv_subscriber import KvSubscriber
from server.router.load import PrefillBacklog
from server.router.metrics import RouterMetrics
from server.router.registry import READY, WorkerHandle, WorkerSpec, route_pd
from server.worker.kv_feed import KvFeed
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import TokenDelta, WorkerStats

PS = 4
PROMPT = list(range(100, 141))  # 41 tokens: 10 whole pages of the first 40


def _handle(wid: str, role: str, addr: str = "tcp://127.0.0.1:1", **stats) -> WorkerHandle:
    h = WorkerHandle(WorkerSpec(wid, role, addr), client=None, state=READY)
    h.stats = WorkerStats(
        worker_id=wid, role=role, model="m", capacity_tokens=1000, max_model_len=512, page_size=PS, **stats
    )
    return h


def _pd(
    index: KvIndex,
    metrics: RouterMetrics | None = None,
    slack: int = 4,
    backlog: dict[str, int] | None = None,
    local_max: dict[str, int] | None = None,
):
    """Two prefill and two decode workers (``local_max``: decode workers' --local-prefill-max-tokens
    as their stats report it) and a policy whose backlog is ``backlog`` (tokens by worker)."""
    local_max = local_max or {}
    handles = [
        _handle(
            w,
            "prefill" if w[0] == "p" else "decode",
            gauges={"local_prefill_max_tokens": float(local_max[w])} if w in local_max else {},
        )
        for w in ("p0", "p1", "d0", "d1")
    ]
    policy = CacheAwarePolicy(
        index,
        balance_slack=slack,
        on_decision=metrics.observe_routing if metrics else None,
        backlog=(lambda w: backlog.get(w, 0)) if backlog else None,
    )
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


def test_prefill_load_is_uncached_tokens_not_requests_and_the_cap_spills():
    index = KvIndex()
    _holds(index, "p1", 10)  # the whole prompt but its last token: P(p1) = 1 + B(p1), P(p0) = 41 + B(p0)
    for backlog, q, expected in (
        ({"p1": 39}, {"p1": 3}, "p1"),  # 40 < 41: three cached requests queued are cheap
        ({"p1": 41}, {}, "p0"),  # 42 > 41
        ({"p1": 20, "p0": 30}, {}, "p1"),
    ):  # 21 < 71
        handles, policy = _pd(index, backlog=backlog)
        assert _ids(policy(handles, _load(q), PROMPT))[0] == expected, (backlog, q)
    metrics = RouterMetrics(lambda: [], lambda: 0)
    handles, policy = _pd(index, metrics, slack=0)
    assert _ids(policy(handles, _load({"p1": 1}), PROMPT))[0] == "p0"  # cheapest, but over the cap
    assert _decisions(metrics) == {"cap": 1.0}


def test_late_turns_spread_by_the_work_queued_not_by_the_number_of_requests():
    # p0: one long uncached prompt ahead (a fresh conversation); p1: four follow-up turns whose
    # prefixes it held (a few uncached tokens each). Counting requests sent the next prompt to p0.
    index = KvIndex()
    handles, policy = _pd(index, backlog={"p0": 512, "p1": 4 * 24})
    route = policy(handles, _load({"p0": 1, "p1": 4}), PROMPT)
    assert _ids(route)[0] == "p1" and route.prefill == ("p1", 41)
    assert _ids(route_pd(handles, _load({"p0": 1, "p1": 4})))[0] == "p0"


def test_a_decode_worker_holding_all_but_a_short_suffix_is_expected_to_prefill_it_itself():
    index, metrics = KvIndex(), RouterMetrics(lambda: [], lambda: 0)
    _holds(index, "p1", 10)
    _holds(index, "d1", 8)  # the conversation so far (prompt and answer): 32 tokens, suffix 9
    handles, policy = _pd(index, metrics, local_max={"d1": 16})
    route = policy(handles, _load({}), PROMPT)
    # local(d1) = 9 against remote(p1, d0) = 1 + 0.5 * 41 = 21.5: d1 computes it, p1 is the fallback
    assert _ids(route) == ["p1", "d1"] and route.prefill == ("d1", 9)
    # a local backlog that would pass --local-prefill-max-tokens: the decode worker refuses, so
    # remote: d1 still ships least (1 + 4.5 against 1 + 20.5), p1 computes
    handles, policy = _pd(index, metrics, local_max={"d1": 16}, backlog={"d1": 8})
    route = policy(handles, _load({}), PROMPT)
    assert _ids(route) == ["p1", "d1"] and route.prefill == ("p1", 1)
    # local prefill off on d1 (gauge 0 or absent): remote
    handles, policy = _pd(index, metrics)
    assert policy(handles, _load({}), PROMPT).prefill == ("p1", 1)
    assert _decisions(metrics) == {"local": 1.0, "prefix": 2.0}


def test_the_local_option_can_change_the_decode_worker():
    # d1 holds 8 pages (suffix 9, local max 16) and runs 2 requests; no prefill worker holds
    # anything (P = 41). d0 idle: remote(d0) = 41 + 20.5 = 61.5 < local(d1) = 9 + 2 * 64 = 137.
    # d0 running 2 as well: remote(d0) = 189.5 > local(d1) = 137 (remote(d1) would be 173.5).
    index = KvIndex()
    _holds(index, "d1", 8)
    handles, policy = _pd(index, local_max={"d1": 16})
    assert _ids(policy(handles, _load({"d1": 2}), PROMPT))[1] == "d0"
    route = policy(handles, _load({"d1": 2, "d0": 2}), PROMPT)
    assert _ids(route)[1] == "d1" and route.prefill == ("d1", 9)


def test_the_routers_own_pending_prefills_count_until_the_first_token():
    """``Route.prefill`` goes into the in-flight table; ``PrefillBacklog`` counts it (or the worker's
    reported backlog, whichever is larger) until the streaming worker's first token."""
    index, table = KvIndex(), InflightTable()
    _holds(index, "d1", 8)
    handles, _ = _pd(index, local_max={"d1": 16})
    by_id = {h.worker_id: h for h in handles}
    backlog = PrefillBacklog(table, by_id)
    policy = CacheAwarePolicy(index, backlog=backlog)

    def send(rid: str):
        route = policy(handles, _load({}), PROMPT)
        table.open(
            rid, tuple(h.worker_id for h in route.targets), route.stream_from.worker_id, 50, prefill=route.prefill
        )
        return route

    assert send("a").prefill == ("d1", 9) and backlog("d1") == 9
    assert send("b").prefill == ("p0", 41)  # 9 + 9 > 16: d1 would refuse; p0 computes the whole prompt
    assert (backlog("p0"), backlog("p1")) == (41, 0)
    assert send("c").prefill == ("p1", 41)  # p0 has 41 tokens queued
    assert table.dispatch("p0", TokenDelta(rid="b", token_ids=[1])) is False  # only the stream worker's tokens
    assert backlog("p0") == 41
    assert table.entry("b").stream_from == "d1"  # remote, but d1 still ships least (4.5 against 20.5)
    table.dispatch("d1", TokenDelta(rid="a", token_ids=[5]))
    assert (backlog("d1"), backlog("p0")) == (0, 41)
    table.dispatch("d1", TokenDelta(rid="b", token_ids=[5]))
    assert backlog("p0") == 0
    by_id["p1"].stats.gauges["prefill_backlog_tokens"] = 100.0  # all routers' work the worker reports
    assert backlog("p1") == 100
    table.close("c")
    by_id["d1"].stats.gauges["local_prefill_backlog_tokens"] = 12.0
    assert backlog("d1") == 12 and send("d").prefill == ("p0", 41)


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
    return {
        tuple(sorted(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
        if s.name == name
    }


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
            await _until(
                lambda: not index.needs_snapshot("p0") and index.held("p0") == frozenset(tree_hashes(new_tree))
            )
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
        (("cause", "gap"),): 1.0,
        (("cause", "initial"),): float(initial),
        (("cause", "restart"),): float(restarts),
    }
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


def test_cache_aware_is_the_default_and_a_decode_pin_wins_over_it():
    """``PdserveConfig()`` routes cache-aware (index, feed subscriber, policy); ``--route-decode``
    pins every PD request's decode worker whatever ``--routing`` says (the migration tests and
    benches load one decode worker through it), so no cache-aware policy or subscriber is built."""
    from configs.schema import PdserveConfig
    from server.router.app import build_context

    specs = [
        WorkerSpec("prefill-0", "prefill", "tcp://x"),
        WorkerSpec("decode-0", "decode", "tcp://y"),
        WorkerSpec("decode-1", "decode", "tcp://z"),
    ]
    default = build_context(PdserveConfig(), None, "m", specs, lambda *a: object())
    assert isinstance(default.registry.policy, CacheAwarePolicy) and default.kv_subscriber is not None
    pinned = build_context(
        PdserveConfig.model_validate({"server": {"route_decode": "decode-0"}}), None, "m", specs, lambda *a: object()
    )
    assert not isinstance(pinned.registry.policy, CacheAwarePolicy) and pinned.kv_subscriber is None
    route = pinned.registry.policy(list(pinned.registry.handles.values()), lambda worker_id: 0, [1, 2, 3])
    assert route.stream_from.worker_id == "decode-0"
