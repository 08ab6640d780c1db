"""What the workers report for cache-aware routing's load term (server/router/load.py,
``PrefillBacklog``), on the real schedulers of the in-process PD harness: a prefill worker's
``prefill_backlog_tokens`` (prompt tokens its cache did not hold on arrival, until computed) and a
decode worker's ``local_prefill_max_tokens`` / ``local_prefill_backlog_tokens`` (its own prefills'
uncached suffixes, until computed). And the router's local-prefill prediction against the decode
worker's own decision: the decode worker's real tree, fed to the router's index, makes the policy
expect a local prefill of exactly the suffix the decode worker then computes itself. Outputs stay
equal to transformers."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PREFILL_ADDR, ROUTER, PDHarness, checked_harnesses
from cache.kv_events import tree_hashes
from decode_worker.local_prefill import LocalPrefillReason
from server.router.cache_routing import CacheAwarePolicy
from server.router.kv_index import KvIndex
from server.router.workers import READY, WorkerHandle, WorkerSpec
from server.worker.loop import worker_stats
from tests.decode_worker.test_local_prefill import lp_cfg
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from transfer.wire.outbox import Conn
from transfer.wire.protocol import GenerateRequest, PrefillRequest, ids_frame

pytestmark = pytest.mark.unit


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda d=None: PDHarness(pd_cfg(), d or lp_cfg(0), tiny[0], tiny[1]))


def _gauges(scheduler, wid: str) -> dict[str, float]:
    return worker_stats(scheduler, wid, "i", "m").gauges


def test_prefill_backlog_counts_uncached_tokens_until_computed(harness, tiny):
    h = harness()
    first = pd_prompts(1, 40, 40, seed=7)[0]
    h.submit("a", first, GREEDY)
    assert h.run()["a"]["tokens"] == hf_greedy(tiny[2], first, 16)
    assert _gauges(h.prefill, "p0")["prefill_backlog_tokens"] == 0
    # two new prompts wait for their decode destinations: one extends the cached 40 tokens (10
    # pages of 4) by 5, one shares nothing
    follow, fresh = first + [5, 6, 7, 8, 9], pd_prompts(1, 30, 30, seed=8)[0]
    for rid, room, ids in (("b", 101, follow), ("c", 102, fresh)):
        h.prefill.handle(
            Conn(ROUTER), PrefillRequest(rid=rid, room=room, params=GREEDY, decode_worker="d0"), [ids_frame(ids)]
        )
    assert _gauges(h.prefill, "p0")["prefill_backlog_tokens"] == (len(follow) - 40) + len(fresh)
    for rid in ("b", "c"):
        h.prefill.abort(rid)  # the router gave up on them: they leave the backlog
    assert _gauges(h.prefill, "p0")["prefill_backlog_tokens"] == 0


def test_decode_worker_reports_its_local_prefill_bound_and_backlog(harness, tiny):
    h = harness(d=lp_cfg(64, backlog=1.5))
    assert _gauges(h.decode, "d0")["local_prefill_max_tokens"] == 64
    assert _gauges(h.decode, "d0")["local_prefill_backlog_ratio"] == 1.5  # the SLO planner reads it
    p = pd_prompts(1, 30, 30, seed=9)[0]
    h.deliver(
        h.decode.add(ROUTER, GenerateRequest(rid="l", params=GREEDY, room=7, prefill_addr=PREFILL_ADDR), p), True
    )  # taken: its PrefillWithdrawn goes to the prefill side
    assert _gauges(h.decode, "d0")["local_prefill_backlog_tokens"] == len(p)
    h.prefill.handle(Conn(ROUTER), PrefillRequest(rid="l", room=7, params=GREEDY, decode_worker="d0"), [ids_frame(p)])
    out = h.run()
    assert out["l"]["tokens"] == hf_greedy(tiny[2], p, 16)
    assert _gauges(h.decode, "d0")["local_prefill_backlog_tokens"] == 0 and not h.prefill.jobs
    assert _gauges(h.prefill, "p0")["prefill_backlog_tokens"] == 0  # withdrawn, never computed there


def test_the_routers_local_prediction_matches_the_decode_workers_decision(harness, tiny):
    h = harness(d=lp_cfg(12))
    turn1 = pd_prompts(1, 40, 40, seed=5)[0]
    h.submit("a", turn1, GREEDY)
    answer = h.run()["a"]["tokens"]
    turn2 = turn1 + answer[:8] + [3, 4]  # the decode worker holds turn 1's prompt and answer: 48 tokens match
    index = KvIndex()
    index.apply_snapshot("d0", "i", 1, tree_hashes(h.decode.kv.tree))
    handles = []
    for wid, role, scheduler in (("p0", "prefill", h.prefill), ("d0", "decode", h.decode)):
        handles.append(
            WorkerHandle(
                WorkerSpec(wid, role, "tcp://127.0.0.1:1"),
                client=None,
                state=READY,
                stats=worker_stats(scheduler, wid, "i", "m"),
            )
        )
    route = CacheAwarePolicy(index)(handles, lambda _w: (0, 0.0, 0), turn2)
    assert route.prefill == ("d0", len(turn2) - 48)
    h.submit("b", turn2, GREEDY)
    assert h.run()["b"]["tokens"] == hf_greedy(tiny[2], turn2, 16)
    assert h.decode.local.decisions[LocalPrefillReason.TAKEN] == 1 and h.decode.local.tokens == len(turn2) - 48


def test_a_prompt_part_way_through_its_chunks_is_reported_prefilling(harness, tiny):
    """``queue_prefilling`` (``pdserve_queue_requests{queue="prefilling"}``): 1 while a prompt has
    chunks left, in no other queue then (it left ``waiting``; its KV is not being written yet)."""
    h = PDHarness(pd_cfg(chunked_prefill_size=8), lp_cfg(0), tiny[0], tiny[1])
    try:
        p = pd_prompts(1, 30, 30, seed=11)[0]
        h.submit("a", p, GREEDY)
        seen = []
        while h.busy:
            h.step()
            g = _gauges(h.prefill, "p0")
            seen.append((g["queue_prefilling"], g["queue_waiting"]))
        # first turn: the destination comes; then 30 tokens in chunks of 8 (the fourth chunk ends it)
        assert [pf for pf, _ in seen[:5]] == [0, 1, 1, 1, 0] and sum(pf for pf, _ in seen) == 3
        assert all(w == 0 for _, w in seen)  # it left "waiting" when its first chunk ran
        h.check_clean()
    finally:
        h.close()
