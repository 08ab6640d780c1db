"""KV transports between two real OS processes: the same tests run over every real backend (NIXL,
ucxx) and each backend's options: exact page placement, a dead peer, a restarted peer, a target
that stops polling.

These tests never skip: if NIXL or ucxx cannot be imported or cannot move data here, they fail
with the reason. They run before ``test_transport_inprocess.py`` (file order): NIXL's and ucxx's
UCX libraries do not share one process in the other order (NIXL after ucxx segfaults).
"""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
import signal
import time

import numpy as np
import pytest

from tests.support.transport_dead_peer import run_child, run_python
from tests.support.transport_peers import check, reap, spawn_target
from tests.support.transport_pools import PAGE_BYTES, SHAPE, make_pool
from transfer.factory import create_transport

pytestmark = pytest.mark.process  # every test spawns a peer process

# ---- real backends in two processes --------------------------------------------------------

# (backend, transport options): every real data plane and each of its modes.
# nixl-threads: NIXL's UCX thread pool (the migration transport's copy threads); split_pages=4 cuts
# the 20-page write below into parallel chunks, the single-page writes stay on the caller's thread.
BACKENDS = [
    ("nixl", {"dlist_form": "list"}),
    ("nixl", {"dlist_form": "strided"}),
    ("nixl", {"copy_threads": 2, "split_pages": 4}),
    ("ucxx", {"error_handling": False}),
    ("ucxx", {"error_handling": True}),
    ("ucxx", {"error_handling": False, "copy_lanes": 2, "lane_min_bytes": 8 * PAGE_BYTES}),
    ("ucxx", {"error_handling": True, "copy_lanes": 3, "lane_min_bytes": 8 * PAGE_BYTES}),
]
IDS = ["nixl-list", "nixl-strided", "nixl-threads", "ucxx-eh-off", "ucxx-eh-on", "ucxx-lanes", "ucxx-eh-on-lanes"]
# ucxx-lanes: the target pulls the 20-page write on its copy lanes (transfer/ucxx_lanes.py), the
# single-page writes on its main worker (lane_min_bytes: 8 of these small pages).


@pytest.mark.parametrize("backend,opts", BACKENDS, ids=IDS)
def test_two_process_write(backend, opts):
    ctx = mp.get_context("spawn")
    p, conn, md = spawn_target(ctx, backend, f"{backend}-dec", opts)
    t = None
    try:
        meta = json.loads(md)  # plain JSON, the backend's own blob as base64
        assert meta["backend"] == backend and meta["page_bytes"] == PAGE_BYTES
        assert meta["num_pages"] == SHAPE[0] and meta["mem_type"] == "DRAM"
        assert base64.b64decode(meta["nixl_md" if backend == "nixl" else "ucx_address"])
        if backend == "ucxx":
            assert len(meta["ucx_lanes"]) == opts.get("copy_lanes", 0)

        t = create_transport(backend, f"{backend}-pre", **opts)
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        assert peer == f"{backend}-dec" and t.add_peer(md) == peer and t.peers() == [peer]

        rng = np.random.default_rng(0)
        run_s, run_d = np.arange(10, 14), np.arange(30, 34)  # a run NIXL can merge
        src = np.r_[run_s, rng.choice(np.setdiff1d(np.arange(SHAPE[0]), run_s), 16, replace=False)]
        dst = np.r_[run_d, rng.choice(np.setdiff1d(np.arange(SHAPE[0]), run_d), 16, replace=False)]
        src, dst = src.astype(np.int32), dst.astype(np.int32)
        for args, msg in [
            (("nobody", src, dst), "unknown peer"),
            ((peer, src, dst[:-1]), "lengths"),
            ((peer, src, np.r_[dst[:-1], 48]), "out of range"),
        ]:
            with pytest.raises(ValueError, match=msg):
                t.write_pages(*args, notif=b"bad")

        t0 = time.monotonic()
        h = t.write_pages(peer, src, dst, b"req-1")
        assert h.wait(10) == "done", h.error
        elapsed = time.monotonic() - t0
        h.release()
        h2 = t.write_pages(peer, [], [], b"req-2")  # notification only
        assert h2.wait(10) == "done", h2.error

        rep = check(conn, src, dst, 2)
        assert rep["bad_pages"] == [], f"pages with wrong bytes: {rep['bad_pages']}"
        assert rep["notifs"] == [(f"{backend}-pre", b"req-1"), (f"{backend}-pre", b"req-2")]
        assert rep["lane_writes"] == ((1 if opts.get("copy_lanes") else 0) if backend == "ucxx" else None)
        assert elapsed < 5

        # several writes in flight at once: every notif exactly once (NIXL may reorder concurrent
        # writes' notifications: seen with the strided form; ucxx delivers them in write order)
        hs = [t.write_pages(peer, [i], [40 + i], f"n{i}".encode()) for i in range(4)]
        assert [x.wait(10) for x in hs] == ["done"] * 4, [x.error for x in hs]
        rep = check(conn, np.r_[src, 0, 1, 2, 3], np.r_[dst, 40, 41, 42, 43], 4)
        assert rep["bad_pages"] == []
        want = [(f"{backend}-pre", f"n{i}".encode()) for i in range(4)]
        assert sorted(rep["notifs"]) == want
        if backend == "ucxx":
            assert rep["notifs"] == want
            assert rep["lane_writes"] == (1 if opts.get("copy_lanes") else 0)  # small writes: main worker
        conn.send(("bye",))
        p.join(10)
        assert p.exitcode == 0
    finally:
        if t is not None:
            t.close()
        reap(p)


# (backend, options, limit_s, extra environment of the child). UCX_RCACHE_ENABLE=n: a UCX context
# without a registration cache, as ucxx gets when NIXL's UCX copy was set up first in the process.
# UCX 1.21 then dereferences a NULL rcache when a rendezvous send fails at once on a dead peer
# (ucp_proto_rndv_rts_abort -> ucp_memh_invalidate): SIGSEGV inside tag_send, 100% of runs, until
# the ucxx backend stopped posting page sends on an endpoint UCX reported failed.
# nixl-threads: split_pages=2 cuts the scenario's 3-page writes into chunks on the pool's threads;
# ucxx-lanes: lane_min_bytes of 2 pages sends them over the target's copy lanes.
DEAD_PEER = [
    ("nixl", {}, 3.0, {}),
    ("nixl", {"copy_threads": 2, "split_pages": 2}, 3.0, {}),
    ("ucxx", {"error_handling": False, "write_timeout_s": 1.5}, 3.0, {}),
    ("ucxx", {"error_handling": True}, 3.0, {}),
    ("ucxx", {"error_handling": True}, 3.0, {"UCX_RCACHE_ENABLE": "n"}),
    (
        "ucxx",
        {"error_handling": False, "write_timeout_s": 1.5, "copy_lanes": 2, "lane_min_bytes": 2 * PAGE_BYTES},
        3.0,
        {},
    ),
    ("ucxx", {"error_handling": True, "copy_lanes": 2, "lane_min_bytes": 2 * PAGE_BYTES}, 3.0, {}),
]


@pytest.mark.parametrize(
    "backend,opts,limit_s,env",
    DEAD_PEER,
    ids=["nixl", "nixl-threads", "ucxx-eh-off", "ucxx-eh-on", "ucxx-eh-on-no-rcache", "ucxx-lanes", "ucxx-eh-on-lanes"],
)
def test_dead_peer_reports_error_then_restarted_peer_works(backend, opts, limit_s, env):
    """kill -9 of the target: the write ends ``"error"`` within ``limit_s`` (for ucxx without error
    handling that is its write deadline), never hangs; the restarted target works again.

    The scenario (``transport_dead_peer.scenario``, every assertion there) runs in a fresh child
    process holding only this backend's UCX, so a native crash is one failed test with the child's
    signal and faulthandler stack, not the death of the run. In one process in CI's order (ucxx
    loaded, then NIXL's UCX copy set up, then ucxx used) the ucxx-eh-on case crashed in every run
    until the ucxx backend stopped posting page sends on a failed endpoint; alone in a process it
    never crashed (32 runs under load). No retry: a crash here is a bug to look at."""
    res = run_child(backend, opts, limit_s, env)
    assert res.returncode == 0, res.describe()


def test_a_crashing_child_is_one_failure_with_its_signal_and_stack():
    """The child runner turns a native crash into a result: the signal's name and faulthandler's
    stack in the report, nothing raised here; a timeout kills the child and says so."""
    res = run_python(["-c", "import ctypes; ctypes.string_at(0)"], timeout_s=30)
    assert res.crashed and res.returncode == -signal.SIGSEGV
    assert "killed by SIGSEGV" in res.describe() and "Fatal Python error: Segmentation fault" in res.stderr_tail
    res = run_python(["-c", "assert 1 == 2, 'the child failed'"], timeout_s=30)
    assert not res.crashed and res.returncode == 1 and "the child failed" in res.describe()
    res = run_python(["-c", "import time; time.sleep(60)"], timeout_s=1)
    assert res.returncode is None and not res.crashed and "timed out" in res.describe()
    assert "Fatal Python error: Aborted" in res.stderr_tail, res.stderr_tail  # where it hung


# ---- ucxx specifics ----------------------------------------------------------------------------


@pytest.mark.parametrize("error_handling", [False, True], ids=["eh-off", "eh-on"])
def test_ucxx_target_that_stops_polling_fails_the_write_at_its_deadline(error_handling):
    """A live target that does not poll past the deadline: the initiator reports ``"error"`` and
    aborts the connection; the target reads the late header only into scratch (no notif, pool pages
    untouched); the next write reconnects and lands."""
    ctx = mp.get_context("spawn")
    opts = {"error_handling": error_handling, "write_timeout_s": 1.0}
    p, conn, md = spawn_target(ctx, "ucxx", "ucxx-dec4", opts)
    t = create_transport("ucxx", "ucxx-pre4", **opts)
    try:
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        assert t.write_pages(peer, [1], [2], b"warm").wait(10) == "done"
        assert check(conn, [1], [2], 1)["notifs"] == [("ucxx-pre4", b"warm")]
        paused = time.monotonic()
        conn.send(("pause", 1.8))
        time.sleep(0.2)
        h = t.write_pages(peer, [5, 6], [7, 8], b"late")
        assert h.wait(5) == "error" and "write_timeout_s=1" in h.error, h.error
        assert 0.9 < time.monotonic() - paused - 0.2 < 1.6
        time.sleep(max(0.0, paused + 2.2 - time.monotonic()))  # the target polls again
        h2 = t.write_pages(peer, [9], [10], b"after")  # new connection
        assert h2.wait(10) == "done", h2.error
        rep = check(conn, [1, 9], [2, 10], 1)
        assert rep["notifs"] == [("ucxx-pre4", b"after")]
        assert rep["bad_pages"] == [], "the aborted write's pages 7, 8 must stay untouched"
        conn.send(("bye",))
        p.join(10)
    finally:
        t.close()
        reap(p)


def test_prefill_sender_write_reaches_its_target_before_the_scheduler_polls_it():
    """A NIXL write's notification leaves from status calls, not with the copy: the prefill side's
    writing thread polls the write it posted (``KVSender``, ``notifies_on_poll``), so the decode
    side hears of the pages while the scheduler computes its next prefill step and has not called
    ``poll`` yet (before: only at that step's end; PD at 8 clients, 300 ms of a 1.3 s TTFT)."""
    from cache.kv_pools import PoolGeometry
    from prefill_worker.kv_sender import KVSender, _Peer
    from transfer.wire.manifest import TransferManifest

    ctx = mp.get_context("spawn")
    p, conn, md = spawn_target(ctx, "nixl", "nixl-dec-sender", {})
    t = sender = None
    try:
        t = create_transport("nixl", "nixl-pre-sender")
        assert t.notifies_on_poll
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        sender = KVSender(t, PAGE_BYTES)
        sender.peers["decode-0"] = _Peer(None, t.add_peer(md), PoolGeometry(SHAPE[0], 1, 0))
        src, dst = np.array([3, 4, 9], dtype=np.int32), np.array([20, 5, 33], dtype=np.int32)
        manifest = TransferManifest(rid="r1", room=1, generation=0, n_tokens=40, n_pages=3, first_token=7)
        sender.start("job", "decode-0", src, dst, manifest)
        sender.inflight[0].future.result(10)  # the writing thread is done with it; nobody polled
        rep = check(conn, src, dst, 1)
        assert rep["bad_pages"] == []
        assert [n for _, n in rep["notifs"]] == [manifest.model_dump_json().encode()]
        ended = sender.poll()
        assert [(w.job, w.ok) for w in ended] == [("job", True)] and not sender.busy
        # the write's end is the writing thread's (not this later poll's): the check above took 0.2 s+
        assert ended[0].seconds < 0.15 and ended[0].ended_at < time.monotonic() - 0.15
        conn.send(("bye",))
        p.join(10)
    finally:
        if sender is not None:
            sender.close()
        if t is not None:
            t.close()
        reap(p)
