"""KV transports in one process: loopback, ucxx's wire format and argument checks, the factory,
the state checks every backend shares, and the package's import structure. The two-process tests
of every real backend are in ``test_transport.py``.

These tests never skip: if NIXL or ucxx cannot be imported here, they fail with the reason.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.transport_pools import PAGE_BYTES, SHAPE, expected_page, make_pool, page_words
from transfer.factory import create_transport
from transfer.kv_transport import KVTransport, TransferHandle
from transfer.loopback import LoopbackTransport

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
        pre.add_peer(
            json.dumps(
                {"format": "pdserve-kv-transport/1", "backend": "nixl", "name": "x", "page_bytes": 1, "num_pages": 1}
            ).encode()
        )
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


# ---- ucxx specifics ----------------------------------------------------------------------------
def test_ucxx_header_wire_format():
    from transfer.ucxx_wire import VERSION, WriteHeader, pack_header, page_tag, unpack_header

    h = WriteHeader("pre-0", 0xDEADBEEF, 7, np.array([3, 1, 2], dtype=np.int32), b'{"rid": "r"}', 123.5)
    back = unpack_header(pack_header(h).tobytes())
    assert (back.sender, back.conn_id, back.seq, back.notif, back.deadline) == (
        "pre-0",
        0xDEADBEEF,
        7,
        b'{"rid": "r"}',
        123.5,
    )
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
    assert back.lanes == 0  # default: every page on the target's main worker
    laned = unpack_header(pack_header(WriteHeader("pre-0", 5, 1, np.arange(9, dtype=np.int32), b"", 1.0, 3)).tobytes())
    assert laned.lanes == 3
    from transfer.ucxx_wire import page_lane

    assert [page_lane(i, 3) for i in range(5)] == [0, 1, 2, 0, 1] and page_lane(4, 0) == -1
    with pytest.raises(ValueError, match="0..64 copy lanes"):
        pack_header(WriteHeader("x", 1, 0, np.zeros(1, dtype=np.int32), b"", 0.0, 65))


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
            a.add_peer(
                json.dumps(
                    {
                        "format": "pdserve-kv-transport/1",
                        "backend": "nixl",
                        "name": "x",
                        "page_bytes": 1,
                        "num_pages": 1,
                    }
                ).encode()
            )
        md = json.loads(b.local_metadata())
        with pytest.raises(ValueError, match="page_bytes"):
            a.add_peer(json.dumps({**md, "page_bytes": PAGE_BYTES * 2}).encode())
        with pytest.raises(ValueError, match="ucx_address"):
            a.add_peer(json.dumps({k: v for k, v in md.items() if k != "ucx_address"}).encode())
        peer = a.add_peer(b.local_metadata())
        for args, msg in [
            (("nobody", [0], [0]), "unknown peer"),
            ((peer, [0], [48]), "dst page id 48"),
            ((peer, [0, 1], [5, 5]), "duplicate"),
        ]:
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


def test_decode_transport_takes_its_ucxx_copy_lanes_from_the_config():
    """A decode worker's main transport: ucxx gets ``--ucxx-copy-lanes`` (default 2), NIXL nothing
    (its initiator copies); a transport built so publishes that many lane addresses."""
    from pydantic import ValidationError

    from configs.schema import ClusterConfig
    from transfer.factory import create_transport, receive_options

    assert receive_options("ucxx", ClusterConfig()) == {"copy_lanes": 2}
    assert receive_options("ucxx", ClusterConfig(ucxx_copy_lanes=0)) == {"copy_lanes": 0}
    assert receive_options("nixl", ClusterConfig(ucxx_copy_lanes=4)) == {}
    with pytest.raises(ValidationError, match="ucxx_copy_lanes"):
        ClusterConfig(ucxx_copy_lanes=65)
    with pytest.raises(ValueError, match="copy_lanes must be 0..64"):
        create_transport("ucxx", "ux-lanes-bad", copy_lanes=-1)
    with create_transport("ucxx", "ux-lanes", ClusterConfig(), **receive_options("ucxx", ClusterConfig())) as t:
        t.register_pool(torch.zeros(4, 64), 256)
        assert len(json.loads(t.local_metadata())["ucx_lanes"]) == 2


def test_migration_transport_takes_its_copy_threads_from_the_config():
    """A decode worker's migration transport: NIXL gets ``--migration-copy-threads`` (default 2),
    the other backends nothing; bad values are refused before NIXL is loaded (no NIXL in this
    process: see test_transport.py's note on the UCX libraries' order)."""
    from pydantic import ValidationError

    from configs.schema import ClusterConfig
    from transfer.factory import migration_options
    from transfer.nixl_transport import NixlTransport

    assert migration_options("nixl", ClusterConfig()) == {"copy_threads": 2}
    assert migration_options("nixl", ClusterConfig(migration_copy_threads=0)) == {"copy_threads": 0}
    assert migration_options("ucxx", ClusterConfig(migration_copy_threads=4)) == {}
    assert migration_options("loopback", ClusterConfig()) == {}
    with pytest.raises(ValidationError, match="migration_copy_threads"):
        ClusterConfig(migration_copy_threads=-1)
    with pytest.raises(ValueError, match="copy_threads must be 0..64"):
        NixlTransport("nx-bad", copy_threads=-1)
    with pytest.raises(ValueError, match="split_pages must be >= 1"):
        NixlTransport("nx-bad", copy_threads=2, split_pages=0)


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
            backend,
            f"{backend}-state",
            SHAPE[0],
            SHAPE[0] * PAGE_BYTES,
        )
        assert t.poll_notifs() == [] and t.peers() == []
    finally:
        t.close()
    t.close()  # idempotent
    t.remove_peer("nobody")
    assert t.peers() == []
    for call in (
        t.local_metadata,
        t.poll_notifs,
        lambda: t.register_pool(make_pool(), PAGE_BYTES),
        lambda: t.write_pages("nobody", [0], [0], b"x"),
    ):
        with pytest.raises(RuntimeError, match=f"transport '{backend}-state' is closed"):
            call()


# ---- module structure ------------------------------------------------------------------------


def test_transfer_modules_import_no_cycle_and_the_interface_no_backend():
    """``kv_transport`` (the interface) imports no backend; the factory imports the backends;
    no backend imports the factory: the import graph of ``transfer/`` (lazy imports included) has
    no cycle."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "transfer"
    mods = {p.stem for p in root.glob("*.py")}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
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


def test_a_first_write_imports_nothing_on_the_transfer_thread():
    """A write's page checks (and ucxx's inbox's) import no module on first use: ``np.unique`` did
    (``numpy.ma``, ~0.1 s holding the GIL on the writing thread at a decode worker's first
    migration, its forward stalled that long). Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = """if True:
        import sys
        import numpy as np
        from transfer.kv_transport import check_pages, has_duplicates
        check_pages([1, 2], [3, 4], 8, 8, "peer")
        assert has_duplicates(np.array([3, 1, 3], dtype=np.int32)) and not has_duplicates(np.array([5], np.int32))
        assert not has_duplicates(np.array([], dtype=np.int32))
        print("numpy.ma" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=".")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
