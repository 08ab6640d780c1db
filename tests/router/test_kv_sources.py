"""Decode workers connect to their KV sources ahead (``KVSources``): the router names each decode
worker its prefill workers and decode peers as they become ready; the decode worker handshakes
them then, and the source sets the transport connection up with a page-less warm-up write, so the
first transfer (a prompt's KV, a migration) waits for neither."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import checked_harnesses
from server.router.kv_sources import announce_sources, kv_sources
from server.router.worker_client import WorkerUnavailable
from server.router.workers import READY, WorkerHandle, WorkerSpec
from tests.decode_worker.test_migration import GREEDY, SKEW, cfg, prompts
from tests.support.metrics_scrape import scrape, val
from tests.support.migration_harness import ADDR, ROUTER, MigrationHarness
from tests.support.models import hf_greedy
from transfer.kv_transport import WARMUP_NOTIF
from transfer.wire.enums import Role
from transfer.wire.outbox import Conn
from transfer.wire.protocol import KVHandshake, KVSources, WorkerStats


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.sent, self.fail = [], fail

    def kv_sources(self, msg) -> None:
        if self.fail:
            raise WorkerUnavailable("not reading")
        self.sent.append(msg)


def _h(wid, role=Role.DECODE, model="m", page_size=4, state=READY, instance="i1"):
    stats = WorkerStats(
        worker_id=wid,
        role=role,
        model=model,
        capacity_tokens=100,
        max_model_len=100,
        page_size=page_size,
        instance=instance,
    )
    return WorkerHandle(WorkerSpec(wid, role, f"tcp://{wid}"), _Recorder(), state=state, stats=stats, instance=instance)


def test_router_names_the_ready_sources_of_a_decode_workers_model():
    d1 = _h("d1")
    others = [
        _h("p0", Role.PREFILL),
        _h("p1", Role.PREFILL, model="x"),
        _h("p2", Role.PREFILL, page_size=16),
        _h("d2"),
        _h("d3", page_size=16),
        _h("d4", model="x"),
        _h("d5", state="dead"),
        _h("c0", Role.COLOCATED),
    ]
    assert kv_sources([d1, *others], d1) == KVSources(prefill=["tcp://p0", "tcp://p2"], decode=["tcp://d2"])
    assert kv_sources([d1, *others], others[0]) is None  # only decode workers take KV
    assert kv_sources([d1, *others], others[6]) is None  # nor one that is not ready


def test_announce_sends_a_list_once_per_worker_process_and_again_when_it_changes():
    d1, p0, d2 = _h("d1"), _h("p0", Role.PREFILL), _h("d2", state="starting")
    handles = [d1, p0, d2]
    announce_sources(handles, d1)
    announce_sources(handles, d1)
    assert d1.client.sent == [KVSources(prefill=["tcp://p0"])]
    d2.state = READY  # a peer joined: the list grows
    announce_sources(handles, d1)
    assert d1.client.sent[-1] == KVSources(prefill=["tcp://p0"], decode=["tcp://d2"]) and len(d1.client.sent) == 2
    d1.instance = "i2"  # d1 restarted: its new process knows nobody
    announce_sources(handles, d1)
    assert len(d1.client.sent) == 3 and d1.client.sent[-1] == d1.client.sent[-2]
    d1.client.fail = True  # not delivered: tried again at the next report
    d1.instance = "i3"
    announce_sources(handles, d1)
    d1.client.fail = False
    announce_sources(handles, d1)
    assert len(d1.client.sent) == 4


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(
        lambda d1=None, d2=None: MigrationHarness(
            cfg(), d1 or cfg(pool=96, migrate_after="1", init_new_token_ratio=0.1), d2 or cfg(), tiny[0], tiny[1]
        )
    )


def _announce(h, wid: str, **lists) -> None:
    h.inbox.append((wid, Conn(ROUTER), KVSources(**lists), []))
    h._exchange()  # handshakes out, acks back (each answer is delivered as it is sent)


@pytest.mark.slow
def test_a_migration_to_a_connected_peer_needs_no_handshake(harness, tiny):
    """d2 (which migrates too, so its peers are KV sources) is told its sources: it handshakes p0
    and d1 at once; both source transports warm the connection up (d2 drops the warm-up
    notification); the migrations that follow send no handshake and the tokens equal transformers."""
    h = harness(d2=cfg(migrate_after="1000"))
    assert val(scrape(h.d2), "pdserve_kv_sources") == 0
    _announce(h, "d1", prefill=[ADDR["p0"]], decode=[ADDR["d2"]])
    _announce(h, "d2", prefill=[ADDR["p0"]], decode=[ADDR["d1"]])
    assert val(scrape(h.d2), "pdserve_kv_sources", state="ready") == 2 == val(scrape(h.d2), "pdserve_kv_sources")
    assert h.d2.peers.get(ADDR["p0"]).ready and h.d2.peers.get(ADDR["d1"]).ready
    assert "d2" in h.d1.migration.sender.peers and "d2" in h.workers["p0"].sender.peers
    assert "d1" in h.d2.migration.sender.peers
    raw = [n for _, n in h.d2.transfers.transport.poll_notifs()]
    assert raw == [WARMUP_NOTIF, WARMUP_NOTIF]  # one from p0, one from d1's migration transport
    sent = []
    deliver = h.deliver

    def recording(sender, out):
        sent.extend(m.msg for m in (out.messages if out is not None else []) if isinstance(m.msg, KVHandshake))
        deliver(sender, out)

    h.deliver = recording
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    out = h.run()
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert h.d1.migration_stats.out_done > 0 and sent == []


def test_a_decode_worker_that_migrates_nothing_connects_only_to_prefill_workers(harness):
    h = harness()  # d2 has no --migrate-after
    h.deliver("d2", h.d2.handle(Conn(ROUTER), KVSources(prefill=[ADDR["p0"]], decode=[ADDR["d1"]]), []))
    assert val(scrape(h.d2), "pdserve_kv_sources", state="connecting") == 1  # the handshake is out
    h._exchange()
    assert list(h.d2.peers.by_addr) == [ADDR["p0"]] and h.d2.peers.get(ADDR["p0"]).ready
    assert h.d2.transfers.landed() == []  # p0's warm-up notification is dropped, not a landing
    m = scrape(h.d2)
    assert val(m, "pdserve_kv_sources", state="ready") == 1 and val(m, "pdserve_kv_sources", state="connecting") == 0
    h.d2.peers.get(ADDR["p0"]).last_seen -= 1e6  # p0 fell silent
    h.d2.peers.tick()
    m = scrape(h.d2)
    assert val(m, "pdserve_kv_sources", state="dead") == 1 and val(m, "pdserve_kv_sources", state="ready") == 0


def test_a_peer_that_migrates_nothing_refuses_to_be_a_kv_source(harness):
    h = harness(d1=cfg(), d2=cfg(migrate_after="1000"))  # d1 has no --migrate-after: no migration transport
    _announce(h, "d2", decode=[ADDR["d1"]])
    peer = h.d2.peers.get(ADDR["d1"])
    assert peer.state == "failed" and "--migrate-after" in peer.error
    m = scrape(h.d2)
    assert val(m, "pdserve_kv_sources", state="failed") == 1 and val(m, "pdserve_kv_sources", state="ready") == 0
