"""Liveness apart from progress: a busy decode worker never turns a live prefill peer
dead; a prefill worker that answers heartbeats while its scheduler is stuck is failed by the
progress watchdog (``progress_timeout_s``) with an error that says so; a SIGSTOPped one is dead."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from decode_worker.peers import PrefillPeers
from server.worker.control_io import ControlIO
from server.worker.peer_pinger import PeerPinger
from tests.support.models import hf_greedy
from tests.support.pd_processes import PDPair, prompts, until_eos, wait_idle
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import KVHandshake, WorkerStats
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def stats(stalled_s=0.0, instance="i1"):
    return WorkerStats(
        worker_id="p0",
        instance=instance,
        role="prefill",
        model="m",
        capacity_tokens=1,
        max_model_len=1,
        page_size=1,
        stalled_s=stalled_s,
    )


def peers(timeout_s=2.0, progress_timeout_s=10.0) -> PrefillPeers:
    hs = KVHandshake(worker_id="d0", model="m", layout={}, transport="loopback", transport_metadata="")
    p = PrefillPeers(hs, timeout_s, progress_timeout_s)
    p.connect("tcp://p")
    peer = p.get("tcp://p")
    peer.last_seen = peer.progress_at = time.monotonic() - 20  # connected 20 s ago
    return p


def test_reply_stamped_by_the_pinger_counts_although_the_scheduler_read_it_late():
    p = peers()  # the scheduler thread was busy in one step for 20 s ...
    p.heard("tcp://p", stats(), time.monotonic() - 0.2)  # ... while the pinger heard the peer
    assert p.tick()[1] == [] and p.get("tcp://p").state == "connecting"


def test_answering_but_stuck_peer_fails_then_rejoins_once_it_progresses():
    p = peers()
    p.heard("tcp://p", stats(stalled_s=9.0), time.monotonic())
    assert p.tick()[1] == []  # a long step is not stuck
    p = peers()
    p.heard("tcp://p", stats(stalled_s=11.0), time.monotonic())
    died = p.tick()[1]
    assert [d.addr for d in died] == ["tcp://p"]
    assert "answers heartbeats but its scheduler made no progress for 11s (progress_timeout_s=10)" in died[0].error
    assert not p.heard("tcp://p", stats(stalled_s=12.0), time.monotonic()).messages  # still stuck: no rejoin
    assert p.get("tcp://p").unusable
    rejoin = p.heard("tcp://p", stats(stalled_s=0.0), time.monotonic())
    assert [type(m.msg).__name__ for m in rejoin.messages] == ["KVHandshake"]


def test_pinger_hears_a_worker_whose_scheduler_thread_never_reads():
    ctx = zmq.Context()
    auth = ControlAuth(ClusterKey.generate())  # the pinger's sockets present the worker's cluster key
    io = ControlIO(ctx, "tcp://127.0.0.1:0", stall_limit_s=30, auth=auth)
    addr = io.router.getsockopt(zmq.LAST_ENDPOINT).decode()
    io.publish(stats())
    io.start()
    pinger = PeerPinger(ctx, interval_s=0.05, auth=auth)
    pinger.start()
    try:
        pinger.watch(addr)
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
            seen += [s.stalled_s for a, s, _ in pinger.take() if a == addr]
        assert len(seen) >= 3 and seen == sorted(seen) and seen[-1] > 0  # answered, and stalling shows
    finally:
        pinger.close()
        io.close()
        ctx.term()


@pytest.mark.process  # worker subprocesses (PDPair)
def test_busy_decode_worker_keeps_its_live_prefill_peer(tiny, tiny_folder):
    """The finding: each decode step (here made 2 s long, as on an oversubscribed machine) is
    longer than peer_timeout_s; the prefill worker answers all along. Every request completes."""
    pair = PDPair(
        tiny_folder,
        decode_pool=512,
        host_gb=0.0,
        cluster={"peer_timeout_s": 1.5},
        decode_sched={"test_step_delay_s": 2.0},
    )
    try:
        ps = prompts(4, 8, 24, seed=5)
        for i, p in enumerate(ps):
            pair.submit(f"b{i}", p, GREEDY)
        out = pair.collect([f"b{i}" for i in range(4)], timeout=120)
        assert [out[f"b{i}"]["error"] for i in range(4)] == [None] * 4
        assert [out[f"b{i}"]["tokens"] for i in range(4)] == [until_eos(hf_greedy(tiny[2], p, 4)) for p in ps]
    finally:
        pair.close()


@pytest.mark.process  # worker subprocesses (PDPair)
def test_stuck_prefill_scheduler_is_failed_by_the_progress_watchdog(tiny_folder):
    """The prefill scheduler thread sleeps for 10 minutes after its first step, the first 4-token
    chunk of a 10-token prompt (so no KV write was posted: a posted one completes on the writing
    thread); its control thread keeps answering. The decode side fails the request as stuck, not
    as silent."""
    pair = PDPair(
        tiny_folder,
        decode_pool=512,
        host_gb=0.0,
        cluster={"peer_timeout_s": 2.0, "progress_timeout_s": 4.0},
        prefill_sched={"test_step_delay_s": 600.0, "chunked_prefill_size": 4},
    )
    try:
        pair.submit("s", prompts(1, 10, 10, seed=3)[0], GREEDY)
        res = pair.collect(["s"], timeout=30)["s"]
        assert res["finish"] == "abort"
        assert "answers heartbeats but its scheduler made no progress" in res["error"]
        assert "progress_timeout_s=4" in res["error"]
        assert pair.procs["p0"].poll() is None  # alive all along
        assert wait_idle(pair, "d0").gauges["kv_pages_used"] == 0
    finally:
        pair.procs["p0"].kill()
        pair.close()


@pytest.mark.process  # worker subprocesses (PDPair)
def test_sigstopped_prefill_worker_is_dead_not_stuck(tiny_folder):
    pair = PDPair(tiny_folder, decode_pool=512, host_gb=0.0)
    try:
        os.kill(pair.procs["p0"].pid, signal.SIGSTOP)
        pair.submit("z", prompts(1, 10, 10, seed=4)[0], GREEDY)
        res = pair.collect(["z"], timeout=30)["z"]
        assert res["finish"] == "abort" and "did not answer for 2s" in res["error"]
    finally:
        os.kill(pair.procs["p0"].pid, signal.SIGCONT)
        pair.close()


def test_pinger_without_peers_sleeps_instead_of_spinning(monkeypatch):
    # colocated and prefill workers have no peers: an empty zmq poll returns at once, so a loop
    # around it alone spun a core and starved the scheduler thread (decode 7x slower)

    turns = []
    real = PeerPinger._connect_new
    monkeypatch.setattr(PeerPinger, "_connect_new", lambda self, *a: turns.append(1) or real(self, *a))
    pinger = PeerPinger(zmq.Context.instance(), interval_s=0.5, auth=ControlAuth.insecure())
    pinger.start()
    time.sleep(0.5)
    pinger.close()
    assert 1 <= len(turns) < 50  # ~5 turns of 100 ms; a spinning loop makes hundreds of thousands
