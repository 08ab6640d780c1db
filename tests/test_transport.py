"""KV transports: loopback (in-process), and NIXL and ucxx between two real OS processes: the same
tests run over every real backend (and each backend's options).

These tests never skip: if NIXL or ucxx cannot be imported or cannot move data here, they fail
with the reason.
"""
from __future__ import annotations

import base64
import json
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from transfer.factory import create_transport
from transfer.kv_transport import KVTransport, TransferHandle
from transfer.loopback import LoopbackTransport

# A small page-major pool: [pages, layers, 2, page_size, kv_heads, head_dim], fp32.
SHAPE = (48, 2, 2, 8, 2, 32)
PAGE_BYTES = int(np.prod(SHAPE[1:])) * 4  # 8 KiB


def make_pool(shape=SHAPE, fill: bool = False) -> torch.Tensor:
    buf = torch.zeros(shape, dtype=torch.float32)
    if fill:
        fill_pattern(buf)
    return buf


def fill_pattern(buf: torch.Tensor) -> None:
    """Page i holds int32 words i * 1_000_003 + j: every page distinct, every byte known."""
    words = buf.view(buf.shape[0], -1).view(torch.int32)
    n = words.shape[1]
    words.copy_(torch.arange(buf.shape[0], dtype=torch.int32)[:, None] * 1_000_003
                + torch.arange(n, dtype=torch.int32)[None, :])


def expected_page(i: int, shape=SHAPE) -> torch.Tensor:
    n = int(np.prod(shape[1:]))
    return torch.arange(n, dtype=torch.int32) + i * 1_000_003


def page_words(buf: torch.Tensor, i: int) -> torch.Tensor:
    return buf[i].reshape(-1).view(torch.int32)


# ---- loopback ------------------------------------------------------------------------------

@pytest.fixture
def loop_pair():
    pre, dec = LoopbackTransport("lb-pre"), LoopbackTransport("lb-dec")
    src, dst = make_pool(fill=True), make_pool()
    pre.register_pool(src, PAGE_BYTES)
    dec.register_pool(dst, PAGE_BYTES)
    yield pre, dec, src, dst
    pre.close()
    dec.close()


def test_loopback_pages_land_exactly(loop_pair):
    pre, dec, src, dst = loop_pair
    assert isinstance(pre, KVTransport)
    src_before = src.clone()
    peer = pre.add_peer(dec.local_metadata())
    assert peer == "lb-dec"
    assert pre.add_peer(dec.local_metadata()) == peer  # idempotent
    s = np.array([3, 0, 7, 5, 47], dtype=np.int32)
    d = np.array([9, 2, 11, 4, 0], dtype=np.int32)
    h = pre.write_pages(peer, s, d, b"req-1")
    assert isinstance(h, TransferHandle)
    assert h.poll() == "done" and h.wait(1.0) == "done" and h.error is None
    h.release()
    for i in range(SHAPE[0]):
        if i in d:
            assert torch.equal(page_words(dst, i), expected_page(int(s[list(d).index(i)]))), i
        else:
            assert not dst[i].any(), f"page {i} was touched"
    assert torch.equal(src, src_before)
    assert dec.poll_notifs() == [("lb-pre", b"req-1")]
    assert dec.poll_notifs() == []  # delivered once
    assert pre.poll_notifs() == []


def test_loopback_empty_write_and_closed_peer(loop_pair):
    pre, dec, _, dst = loop_pair
    peer = pre.add_peer(dec.local_metadata())
    assert pre.write_pages(peer, [], [], b"only-notif").wait(1) == "done"
    assert dec.poll_notifs() == [("lb-pre", b"only-notif")]
    assert not dst.any()
    dec.close()
    h = pre.write_pages(peer, [1], [1], b"x")
    assert h.poll() == "error" and "closed" in h.error
    with pytest.raises(RuntimeError):
        dec.poll_notifs()


def test_loopback_bad_args(loop_pair):
    pre, dec, _, _ = loop_pair
    peer = pre.add_peer(dec.local_metadata())
    cases = [
        (("nobody", [0], [0]), "unknown peer"),
        ((peer, [0, 1], [0]), "different lengths"),
        ((peer, [48], [0]), "src page id 48 out of range"),
        ((peer, [-1], [0]), "src page id -1 out of range"),
        ((peer, [0], [48]), "dst page id 48 out of range"),
        ((peer, [0, 1], [5, 5]), "duplicate"),
        ((peer, [[0]], [[1]]), "1-D"),
        ((peer, [0.5], [1.0]), "integer"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            pre.write_pages(*args, notif=b"x")
    assert dec.poll_notifs() == []
    with pytest.raises(ValueError, match="page_bytes"):
        LoopbackTransport("lb-bad").register_pool(make_pool(), PAGE_BYTES * 2)
    with pytest.raises(ValueError, match="backend"):
        pre.add_peer(json.dumps({"format": "pdserve-kv-transport/1", "backend": "nixl", "name": "x",
                                 "page_bytes": 1, "num_pages": 1}).encode())
    with pytest.raises(ValueError, match="not transport JSON"):
        pre.add_peer(b"\x80\x04pickle")
    other = LoopbackTransport("lb-other")
    other.register_pool(make_pool((4, 2, 2, 8, 2, 16)), PAGE_BYTES // 2)
    with pytest.raises(ValueError, match="page_bytes"):
        pre.add_peer(other.local_metadata())
    other.close()
    with pytest.raises(ValueError, match="already exists"):
        LoopbackTransport("lb-pre")


def test_loopback_metadata_is_json(loop_pair):
    _, dec, _, dst = loop_pair
    md = json.loads(dec.local_metadata())
    assert md["page_bytes"] == PAGE_BYTES and md["num_pages"] == SHAPE[0]
    assert md["base"] == dst.data_ptr() and md["mem_type"] == "DRAM"


# ---- real backends in two processes --------------------------------------------------------

# (backend, transport options): every real data plane and each of its modes.
BACKENDS = [("nixl", {"dlist_form": "list"}), ("nixl", {"dlist_form": "strided"}),
            ("ucxx", {"error_handling": False}), ("ucxx", {"error_handling": True})]
IDS = ["nixl-list", "nixl-strided", "ucxx-eh-off", "ucxx-eh-on"]


def _target(conn, backend: str, name: str, opts: dict) -> None:
    """Decode side: register a zeroed pool, publish metadata, poll notifications, verify on request."""
    t = create_transport(backend, name, **opts)
    buf = make_pool()
    t.register_pool(buf, PAGE_BYTES)
    conn.send_bytes(t.local_metadata())
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got += t.poll_notifs()
        if conn.poll():
            cmd = conn.recv()
            if cmd[0] == "bye":
                break
            if cmd[0] == "pause":  # alive but not polling (a hung scheduler)
                time.sleep(cmd[1])
                continue
            _, src, dst, n_expected = cmd  # ("check", ...): wait for the notifs, then verify
            until = time.monotonic() + 10
            while len(got) < n_expected and time.monotonic() < until:
                got += t.poll_notifs()
                time.sleep(0.0005)
            quiet = time.monotonic() + 0.2  # any duplicate would show up here
            while time.monotonic() < quiet:
                got += t.poll_notifs()
                time.sleep(0.001)
            where = dict(zip(dst, src))
            bad = [i for i in range(buf.shape[0])
                   if not torch.equal(page_words(buf, i), expected_page(where[i]) if i in where
                                      else torch.zeros_like(page_words(buf, i)))]
            conn.send({"notifs": got, "bad_pages": bad})
            got = []
        time.sleep(0.0005)
    t.close()


def _spawn_target(ctx, backend: str, name: str, opts: dict):
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_target, args=(child, backend, name, opts), daemon=True)
    p.start()
    if not parent.poll(30):
        p.kill()
        raise AssertionError(f"{backend} target process published no metadata within 30 s")
    return p, parent, parent.recv_bytes()


def _reap(p) -> None:
    if p.is_alive():
        p.kill()
    p.join(5)


def _check(conn, src, dst, n_notifs: int) -> dict:
    conn.send(("check", list(map(int, src)), list(map(int, dst)), n_notifs))
    assert conn.poll(20), "target did not report"
    return conn.recv()


@pytest.mark.parametrize("backend,opts", BACKENDS, ids=IDS)
def test_two_process_write(backend, opts):
    ctx = mp.get_context("spawn")
    p, conn, md = _spawn_target(ctx, backend, f"{backend}-dec", opts)
    t = None
    try:
        meta = json.loads(md)  # plain JSON, the backend's own blob as base64
        assert meta["backend"] == backend and meta["page_bytes"] == PAGE_BYTES
        assert meta["num_pages"] == SHAPE[0] and meta["mem_type"] == "DRAM"
        assert base64.b64decode(meta["nixl_md" if backend == "nixl" else "ucx_address"])

        t = create_transport(backend, f"{backend}-pre", **opts)
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        assert peer == f"{backend}-dec" and t.add_peer(md) == peer and t.peers() == [peer]

        rng = np.random.default_rng(0)
        run_s, run_d = np.arange(10, 14), np.arange(30, 34)  # a run NIXL can merge
        src = np.r_[run_s, rng.choice(np.setdiff1d(np.arange(SHAPE[0]), run_s), 16, replace=False)]
        dst = np.r_[run_d, rng.choice(np.setdiff1d(np.arange(SHAPE[0]), run_d), 16, replace=False)]
        src, dst = src.astype(np.int32), dst.astype(np.int32)
        for args, msg in [(("nobody", src, dst), "unknown peer"), ((peer, src, dst[:-1]), "lengths"),
                          ((peer, src, np.r_[dst[:-1], 48]), "out of range")]:
            with pytest.raises(ValueError, match=msg):
                t.write_pages(*args, notif=b"bad")

        t0 = time.monotonic()
        h = t.write_pages(peer, src, dst, b"req-1")
        assert h.wait(10) == "done", h.error
        elapsed = time.monotonic() - t0
        h.release()
        h2 = t.write_pages(peer, [], [], b"req-2")  # notification only
        assert h2.wait(10) == "done", h2.error

        rep = _check(conn, src, dst, 2)
        assert rep["bad_pages"] == [], f"pages with wrong bytes: {rep['bad_pages']}"
        assert rep["notifs"] == [(f"{backend}-pre", b"req-1"), (f"{backend}-pre", b"req-2")]
        assert elapsed < 5

        # several writes in flight at once: every notif exactly once (NIXL may reorder concurrent
        # writes' notifications: seen with the strided form; ucxx delivers them in write order)
        hs = [t.write_pages(peer, [i], [40 + i], f"n{i}".encode()) for i in range(4)]
        assert [x.wait(10) for x in hs] == ["done"] * 4, [x.error for x in hs]
        rep = _check(conn, np.r_[src, 0, 1, 2, 3], np.r_[dst, 40, 41, 42, 43], 4)
        assert rep["bad_pages"] == []
        want = [(f"{backend}-pre", f"n{i}".encode()) for i in range(4)]
        assert sorted(rep["notifs"]) == want
        if backend == "ucxx":
            assert rep["notifs"] == want
        conn.send(("bye",))
        p.join(10)
        assert p.exitcode == 0
    finally:
        if t is not None:
            t.close()
        _reap(p)


DEAD_PEER = [("nixl", {}, 3.0), ("ucxx", {"error_handling": False, "write_timeout_s": 1.5}, 3.0),
             ("ucxx", {"error_handling": True}, 3.0)]


@pytest.mark.parametrize("backend,opts,limit_s", DEAD_PEER, ids=["nixl", "ucxx-eh-off", "ucxx-eh-on"])
def test_dead_peer_reports_error_then_restarted_peer_works(backend, opts, limit_s):
    """kill -9 of the target: the write ends ``"error"`` within ``limit_s`` (for ucxx without error
    handling that is its write deadline), never hangs; the restarted target works again."""
    ctx = mp.get_context("spawn")
    p, conn, md = _spawn_target(ctx, backend, f"{backend}-dec2", opts)
    pc, _, mdc = _spawn_target(ctx, backend, f"{backend}-dec3", opts)  # dies before any write reaches it
    p2 = None
    t = create_transport(backend, f"{backend}-pre2", **opts)
    try:
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        cold_peer = t.add_peer(mdc)
        assert t.write_pages(peer, [1, 2], [3, 4], b"warm").wait(10) == "done"

        for proc, name in ((p, peer), (pc, cold_peer)):
            proc.kill()
            proc.join(5)
            t0 = time.monotonic()
            h = t.write_pages(name, [5, 6, 7], [8, 9, 10], b"to-the-dead")
            state = h.wait(limit_s + 5)
            took = time.monotonic() - t0
            assert state == "error", f"write to killed {name} ended {state!r} after {took:.2f}s"
            assert h.error and took < limit_s, (h.error, took)
            h.release()
        t.remove_peer(cold_peer)
        assert t.peers() == [peer]
        with pytest.raises(ValueError, match="unknown peer"):
            t.write_pages(cold_peer, [0], [0], b"x")

        # The decode worker comes back under the same name: new metadata replaces the old peer.
        p2, conn2, md2 = _spawn_target(ctx, backend, f"{backend}-dec2", opts)
        assert md2 != md
        assert t.add_peer(md2) == peer
        h = t.write_pages(peer, [5, 6, 7], [8, 9, 10], b"again")
        assert h.wait(10) == "done", h.error
        rep = _check(conn2, [5, 6, 7], [8, 9, 10], 1)
        assert rep["bad_pages"] == [] and rep["notifs"] == [(f"{backend}-pre2", b"again")]
        conn2.send(("bye",))
        p2.join(10)
    finally:
        t.close()
        _reap(p)
        _reap(pc)
        if p2 is not None:
            _reap(p2)


# ---- ucxx specifics ----------------------------------------------------------------------------

@pytest.mark.parametrize("error_handling", [False, True], ids=["eh-off", "eh-on"])
def test_ucxx_target_that_stops_polling_fails_the_write_at_its_deadline(error_handling):
    """A live target that does not poll past the deadline: the initiator reports ``"error"`` and
    aborts the connection; the target reads the late header only into scratch (no notif, pool pages
    untouched); the next write reconnects and lands."""
    ctx = mp.get_context("spawn")
    opts = {"error_handling": error_handling, "write_timeout_s": 1.0}
    p, conn, md = _spawn_target(ctx, "ucxx", "ucxx-dec4", opts)
    t = create_transport("ucxx", "ucxx-pre4", **opts)
    try:
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        assert t.write_pages(peer, [1], [2], b"warm").wait(10) == "done"
        assert _check(conn, [1], [2], 1)["notifs"] == [("ucxx-pre4", b"warm")]
        paused = time.monotonic()
        conn.send(("pause", 1.8))
        time.sleep(0.2)
        h = t.write_pages(peer, [5, 6], [7, 8], b"late")
        assert h.wait(5) == "error" and "write_timeout_s=1" in h.error, h.error
        assert 0.9 < time.monotonic() - paused - 0.2 < 1.6
        time.sleep(max(0.0, paused + 2.2 - time.monotonic()))  # the target polls again
        h2 = t.write_pages(peer, [9], [10], b"after")  # new connection
        assert h2.wait(10) == "done", h2.error
        rep = _check(conn, [1, 9], [2, 10], 1)
        assert rep["notifs"] == [("ucxx-pre4", b"after")]
        assert rep["bad_pages"] == [], "the aborted write's pages 7, 8 must stay untouched"
        conn.send(("bye",))
        p.join(10)
    finally:
        t.close()
        _reap(p)


def test_ucxx_header_wire_format():
    from transfer.ucxx_wire import VERSION, WriteHeader, pack_header, page_tag, unpack_header

    h = WriteHeader("pre-0", 0xDEADBEEF, 7, np.array([3, 1, 2], dtype=np.int32), b'{"rid": "r"}', 123.5)
    back = unpack_header(pack_header(h).tobytes())
    assert (back.sender, back.conn_id, back.seq, back.notif, back.deadline) == ("pre-0", 0xDEADBEEF, 7,
                                                                                  b'{"rid": "r"}', 123.5)
    assert back.dst_pages.tolist() == [3, 1, 2]
    assert page_tag(0xDEADBEEF, 7, 2) == (0xDEADBEEF << 32) | (7 << 16) | 2
    raw = bytearray(pack_header(h).tobytes())
    raw[4] = VERSION + 1
    with pytest.raises(ValueError, match="version"):
        unpack_header(bytes(raw))
    with pytest.raises(ValueError, match="magic"):
        unpack_header(b"XXXX" + bytes(raw[4:]))
    with pytest.raises(ValueError, match="fields say"):
        unpack_header(pack_header(h).tobytes()[:-1])
    with pytest.raises(ValueError, match="at most"):
        pack_header(WriteHeader("x", 1, 0, np.zeros(70_000, dtype=np.int32), b"", 0.0))


def test_ucxx_bad_args_in_one_process():
    a, b = create_transport("ucxx", "ux-a"), create_transport("ucxx", "ux-b")
    try:
        with pytest.raises(RuntimeError, match="register_pool"):
            a.local_metadata()
        a.register_pool(make_pool(fill=True), PAGE_BYTES)
        b.register_pool(make_pool(), PAGE_BYTES)
        with pytest.raises(ValueError, match="own"):
            a.add_peer(a.local_metadata())
        with pytest.raises(ValueError, match="backend 'nixl'"):
            a.add_peer(json.dumps({"format": "pdserve-kv-transport/1", "backend": "nixl", "name": "x",
                                   "page_bytes": 1, "num_pages": 1}).encode())
        md = json.loads(b.local_metadata())
        with pytest.raises(ValueError, match="page_bytes"):
            a.add_peer(json.dumps({**md, "page_bytes": PAGE_BYTES * 2}).encode())
        with pytest.raises(ValueError, match="ucx_address"):
            a.add_peer(json.dumps({k: v for k, v in md.items() if k != "ucx_address"}).encode())
        peer = a.add_peer(b.local_metadata())
        for args, msg in [(("nobody", [0], [0]), "unknown peer"), ((peer, [0], [48]), "dst page id 48"),
                          ((peer, [0, 1], [5, 5]), "duplicate")]:
            with pytest.raises(ValueError, match=msg):
                a.write_pages(*args, notif=b"x")
        with pytest.raises(ValueError, match="write_timeout_s"):
            create_transport("ucxx", "ux-c", write_timeout_s=0)
        with pytest.raises(ValueError, match="unknown transport 'tcp'"):
            create_transport("tcp", "ux-d")
    finally:
        a.close()
        b.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.write_pages(peer, [0], [0], b"x")


def test_create_transport_takes_the_ucxx_settings_from_the_config():
    from configs.schema import ClusterConfig

    t = create_transport("ucxx", "ux-cfg", ClusterConfig(ucxx_error_handling=True, peer_timeout_s=3.0))
    d = create_transport("ucxx", "ux-cfg2", ClusterConfig())
    try:
        assert t.backend == "ucxx" and t.error_handling is True and t.write_timeout_s == 3.0
        assert d.error_handling is False and d.write_timeout_s == ClusterConfig().peer_timeout_s
        with create_transport("ucxx", "ux-cfg3", ClusterConfig(), write_timeout_s=1.0) as e:
            assert e.write_timeout_s == 1.0  # explicit arguments win over the config
    finally:
        t.close()
        d.close()



@pytest.mark.parametrize("backend", ["loopback", "ucxx"])
def test_state_checks_are_the_same_on_every_backend(backend):
    """The checks ``TransportBase`` runs before any backend code: pool registered once and before
    ``local_metadata``/``write_pages``, nothing but ``close``/``remove_peer``/``peers`` after close."""
    t = create_transport(backend, f"{backend}-state")
    try:
        with pytest.raises(RuntimeError, match="register_pool before local_metadata"):
            t.local_metadata()
        with pytest.raises(RuntimeError, match="register_pool before write_pages"):
            t.write_pages("nobody", [0], [0], b"x")
        with pytest.raises(ValueError, match="notif must be bytes"):
            t.write_pages("nobody", [0], [0], 5)
        with pytest.raises(ValueError, match="page_bytes"):
            t.register_pool(make_pool(), PAGE_BYTES + 1)
        t.register_pool(make_pool(), PAGE_BYTES)
        with pytest.raises(RuntimeError, match="already has a registered pool"):
            t.register_pool(make_pool(), PAGE_BYTES)
        md = json.loads(t.local_metadata())
        assert (md["backend"], md["name"], md["num_pages"], md["length"]) == (
            backend, f"{backend}-state", SHAPE[0], SHAPE[0] * PAGE_BYTES)
        assert t.poll_notifs() == [] and t.peers() == []
    finally:
        t.close()
    t.close()  # idempotent
    t.remove_peer("nobody")
    assert t.peers() == []
    for call in (t.local_metadata, t.poll_notifs, lambda: t.register_pool(make_pool(), PAGE_BYTES),
                 lambda: t.write_pages("nobody", [0], [0], b"x")):
        with pytest.raises(RuntimeError, match=f"transport '{backend}-state' is closed"):
            call()

# ---- module structure ------------------------------------------------------------------------

def test_transfer_modules_import_no_cycle_and_the_interface_no_backend():
    """``kv_transport`` (the interface) imports no backend; the factory imports the backends;
    no backend imports the factory: the import graph of ``transfer/`` (lazy imports included) has
    no cycle."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "transfer"
    mods = {p.stem for p in root.glob("*.py")}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            deps |= {n.split(".")[1] for n in names if n.startswith("transfer.") and n.split(".")[1] in mods}
        graph[m] = deps
    assert graph["kv_transport"] == set()
    assert {"nixl_transport", "ucxx_transport", "loopback"} <= graph["factory"]
    assert not any("factory" in deps for m, deps in graph.items() if m != "factory")

    def reach(m, seen):
        for d in graph[m]:
            if d not in seen:
                seen.add(d)
                reach(d, seen)
        return seen

    assert [m for m in sorted(graph) if m in reach(m, set())] == []
