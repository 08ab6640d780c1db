"""Multi-host pieces without a model: ``--roles`` and worker addresses, ``pdserve probe`` against a
real ZMQ socket and a real HTTP server, the router reconnecting to a silent worker (and libzmq
resolving a name that appears late), and ``/health?require=any``."""

from __future__ import annotations

import asyncio
import io
import socket
import sys
import threading
import time
from contextlib import redirect_stderr
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import zmq
import zmq.asyncio

from configs.schema import PdserveConfig
from server.launch.cli import main as cli_main
from server.launch.probe import ProbeError, local, parse_stats, pid1_argv, probe, target_from_argv
from server.launch.roles import advertised_host, bind_addr, parse_roles, parse_worker_spec, worker_specs
from server.router.inflight import InflightTable
from server.router.registry import DEAD, Registry, WorkerSpec
from server.router.worker_client import WorkerClient
from transfer.cluster_key import ClusterKey, write_key_file
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import StatsRequest, WorkerStats, decode, encode


def pd(**cluster) -> PdserveConfig:
    return PdserveConfig.model_validate({"cluster": {"mode": "pd", "prefill": 2, "decode": 2, **cluster}})


def test_roles_parse_and_refuse_what_the_mode_does_not_run():
    assert parse_roles(None, "pd") == {"router", "prefill", "decode"}
    assert parse_roles(" decode ,router", "pd") == {"router", "decode"}
    with pytest.raises(ValueError, match="pd mode runs router, prefill, decode.*unknown: colocated"):
        parse_roles("colocated", "pd")
    with pytest.raises(ValueError, match="colocated mode runs router, colocated"):
        parse_roles(",", "colocated")


def test_a_subset_of_roles_keeps_the_ports_of_the_full_deployment():
    cfg = pd(base_port=30000, worker_host="0.0.0.0", advertise_host="node-b")
    everything = worker_specs(cfg)
    assert [(s.worker_id, s.addr) for s in everything] == [
        ("prefill-0", "tcp://node-b:30000"),
        ("prefill-1", "tcp://node-b:30001"),
        ("decode-0", "tcp://node-b:30002"),
        ("decode-1", "tcp://node-b:30003"),
    ]
    assert worker_specs(cfg, frozenset({"decode"})) == everything[2:]
    assert bind_addr(everything[3], cfg) == "tcp://0.0.0.0:30003"
    assert advertised_host(pd(worker_host="0.0.0.0")) == socket.gethostname()
    assert advertised_host(pd()) == "127.0.0.1" and worker_specs(pd())[0].addr == "tcp://127.0.0.1:29500"


def test_worker_spec_text_is_checked():
    assert parse_worker_spec("decode=d0=tcp://decode-0:29500") == WorkerSpec("d0", "decode", "tcp://decode-0:29500")
    for bad in ("decode=d0", "router=r=tcp://x:1", "decode==tcp://x:1", "decode=d0=x:1"):
        with pytest.raises(ValueError, match="expected ROLE=ID=tcp://HOST:PORT"):
            parse_worker_spec(bad)


def test_launch_refuses_bad_roles_and_remote_workers_without_a_router(capsys):
    assert cli_main(["launch", "--roles", "decode,colocated"]) == 2
    assert "unknown: colocated" in capsys.readouterr().err
    assert cli_main(["launch", "--roles", "decode", "--worker", "prefill=p=tcp://a:1"]) == 2
    assert "add router to --roles" in capsys.readouterr().err


# ---- pdserve probe -------------------------------------------------------------------------------
def test_probe_target_comes_from_the_main_process_command_line(tmp_path):
    assert (
        target_from_argv(["worker", "--role", "decode", "--worker-id", "d", "--control-addr", "tcp://0.0.0.0:29511"])
        == "tcp://127.0.0.1:29511"
    )
    assert (
        target_from_argv(["router", "--port", "8123", "--host", "0.0.0.0", "--worker", "decode=d=tcp://x:1"])
        == "http://127.0.0.1:8123"
    )
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/opt/venv/bin/python\0/opt/venv/bin/pdserve\0worker\0--role\0prefill\0")
    assert pid1_argv(str(cmdline)) == ["worker", "--role", "prefill"]
    cmdline.write_bytes(b"/bin/sleep\0100\0")
    with pytest.raises(ValueError, match="not a pdserve process"):
        pid1_argv(str(cmdline))
    assert local("tcp://[::]:5") == "tcp://[::1]:5" and local("tcp://10.0.0.2:5") == "tcp://10.0.0.2:5"


def test_probe_reads_worker_stats_and_refuses_anything_else():
    reply = encode(
        WorkerStats(worker_id="d1", role="decode", model="m", capacity_tokens=32, max_model_len=8, page_size=16)
    )
    st = parse_stats("tcp://x:1", reply)
    assert (st.worker_id, st.role, st.model, st.capacity_tokens) == ("d1", "decode", "m", 32)
    with pytest.raises(ProbeError, match="protocol version 99"):
        parse_stats("tcp://x:1", [b"WorkerStats", b'{"version": 99}'])
    with pytest.raises(ProbeError, match="not WorkerStats"):
        parse_stats("tcp://x:1", encode(StatsRequest()))


KEY = ClusterKey.generate()


def fake_worker(answers: bool):
    """A ROUTER socket with the cluster key ``KEY`` answering StatsRequest like a worker (or, not
    ``answers``, silent); (address, stop)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    guard = ControlAuth(KEY).server(sock, "fake worker")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                ident, *parts = sock.recv_multipart()
                msg, _ = decode(parts)
                assert isinstance(msg, StatsRequest)
                if answers:
                    sock.send_multipart(
                        [
                            ident,
                            *encode(
                                WorkerStats(
                                    nonce=msg.nonce,
                                    worker_id="d9",
                                    role="decode",
                                    model="m",
                                    capacity_tokens=64,
                                    max_model_len=64,
                                    page_size=16,
                                )
                            ),
                        ]
                    )
        sock.close(0)
        guard.close()
        ctx.term()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{port}", lambda: (stop.set(), t.join())


@pytest.mark.parametrize("answers", [True, False])
def test_probe_asks_a_worker_socket(answers):
    addr, stop = fake_worker(answers)
    try:
        if answers:
            assert probe(addr, 2.0, ControlAuth(KEY)) == f"decode worker d9 at {addr}: ready (m, 64 tokens)"
        else:
            with pytest.raises(ProbeError, match="no answer"):
                probe(addr, 0.5, ControlAuth(KEY))
    finally:
        stop()


def test_probe_finds_the_key_the_main_process_was_given(monkeypatch):
    from server.launch.probe import key_from_argv

    worker = ["worker", "--role", "decode", "--worker-id", "d", "--control-addr", "tcp://0.0.0.0:1"]
    monkeypatch.delenv("PDSERVE_CLUSTER_KEY", raising=False)
    assert key_from_argv([*worker, "--cluster-key", "/k/a.key"]) == "/k/a.key"
    assert key_from_argv(worker) is None
    monkeypatch.setenv("PDSERVE_CLUSTER_KEY", "/run/secrets/k")  # compose and k8s set it for the probe too
    assert key_from_argv(worker) == "/run/secrets/k"


def test_probe_with_another_key_or_none_says_to_pass_the_cluster_key(tmp_path):
    addr, stop = fake_worker(True)
    try:
        with pytest.raises(ProbeError, match="no answer in 1s .*CURVE.*--cluster-key"):
            probe(addr, 1.0, ControlAuth(ClusterKey.generate()))
        with pytest.raises(ProbeError, match="no answer in 1s .*requires CURVE.*--cluster-key"):
            probe(addr, 1.0, ControlAuth.insecure())
        write_key_file(tmp_path / "k", KEY)
        with redirect_stderr(io.StringIO()):
            assert cli_main(["probe", addr, "--cluster-key", str(tmp_path / "k")]) == 0
    finally:
        stop()


def test_probe_of_a_silent_address_fails_after_its_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: nothing answers
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ProbeError, match="no answer in 0.3s"):
            probe(f"tcp://127.0.0.1:{port}", 0.3, ControlAuth(KEY))
        assert time.monotonic() - t0 < 5


def test_probe_http_health_and_exit_codes():
    status = [503]

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status[0] if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"workers": "decode-0 (decode): starting"}')

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        err = io.StringIO()
        with redirect_stderr(err):
            assert cli_main(["probe", url, "--timeout", "2"]) == 1
        assert "answered 503" in err.getvalue() and "decode-0 (decode): starting" in err.getvalue()
        status[0] = 200
        assert cli_main(["probe", url]) == 0
        with redirect_stderr(io.StringIO()):
            assert cli_main(["probe", "udp://x:1"]) == 2
    finally:
        srv.shutdown()


# ---- router side ---------------------------------------------------------------------------------
def stats(wid: str, role: str = "colocated") -> WorkerStats:
    return WorkerStats(worker_id=wid, role=role, model="m", capacity_tokens=10, max_model_len=10, page_size=1)


def test_router_reconnects_to_a_worker_that_went_silent():
    now = [0.0]

    class Client:
        def __init__(self, *a):
            self.reconnects = 0

        async def start(self):
            pass

        async def close(self):
            pass

        def request_stats(self, nonce):
            pass

        def abort(self, rids, reason):
            pass

        async def reconnect(self):
            self.reconnects += 1

    async def scenario():
        reg = Registry(
            [WorkerSpec("w0", "colocated", "tcp://w0:1"), WorkerSpec("w1", "colocated", "tcp://w1:1")],
            Client,
            InflightTable(),
            interval_s=0.01,
            timeout_s=1.0,
            clock=lambda: now[0],
        )
        await reg.start()
        reg.on_stats("w0", stats("w0"))
        reg.on_stats("w1", stats("w1"))
        now[0] = 0.5
        reg.on_stats("w1", stats("w1"))
        now[0] = 1.2  # w0 silent for 1.2 s, w1 for 0.7 s
        await asyncio.sleep(0.1)
        await reg.close()
        return reg

    reg = asyncio.run(scenario())
    assert reg.handles["w0"].state == DEAD and reg.handles["w0"].client.reconnects == 1
    assert reg.handles["w1"].client.reconnects == 0
    assert not reg.health()[0] and reg.can_route()  # w1 still serves


def test_worker_client_finds_a_name_that_resolves_only_later(tmp_path):
    """libzmq resolves at each connection attempt: a DEALER given an address that does not answer
    yet gets its queued heartbeat answered once a worker binds there, with no new connect call."""
    addr, stop = None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got: list[WorkerStats] = []

    async def scenario():
        nonlocal addr, stop
        ctx = zmq.asyncio.Context()
        c = WorkerClient(
            "d9",
            f"tcp://localhost:{port}",
            ctx,
            lambda *a: None,
            lambda w, s: got.append(s),
            auth=ControlAuth.insecure(),
        )
        await c.start()
        c.request_stats(7)
        await asyncio.sleep(0.5)
        assert got == []
        wctx = zmq.Context()
        wsock = wctx.socket(zmq.ROUTER)
        wsock.bind(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 10
        while not wsock.poll(0):
            assert time.monotonic() < deadline, "the client never connected"
            await asyncio.sleep(0.05)
        ident, *parts = wsock.recv_multipart()
        msg, _ = decode(parts)
        wsock.send_multipart([ident, *encode(stats("d9").model_copy(update={"nonce": msg.nonce}))])
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await c.reconnect()  # a fresh socket works as well
        c.request_stats(8)
        while wsock.poll(2000):
            ident, *parts = wsock.recv_multipart()
            if decode(parts)[0].nonce == 8:
                break
        else:
            raise AssertionError("no heartbeat after reconnect")
        await c.close()
        wsock.close(0)
        wctx.term()
        ctx.term()

    asyncio.run(scenario())
    assert got[0].nonce == 7 and got[0].worker_id == "d9"


def test_health_require_any(tmp_path):
    from fastapi.testclient import TestClient

    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer
    from server.router.app import build_context, create_app

    class Client:
        def __init__(self, spec, on_tokens, on_stats):
            self.spec, self.on_stats = spec, on_stats

        async def start(self):
            pass

        async def close(self):
            pass

        def request_stats(self, nonce):
            if self.spec.worker_id != "decode-1":  # decode-1 never answers
                self.on_stats(self.spec.worker_id, stats(self.spec.worker_id, self.spec.role))

    cfg = PdserveConfig.model_validate({"server": {"health_interval_s": 0.05}, "cluster": {"mode": "pd"}})
    specs = [
        WorkerSpec("prefill-0", "prefill", "x"),
        WorkerSpec("decode-0", "decode", "x"),
        WorkerSpec("decode-1", "decode", "x"),
    ]
    tok = Tokenizer.from_path(resolve_model_path("default"))
    with TestClient(create_app(build_context(cfg, tok, "m", specs, Client))) as http:
        deadline = time.monotonic() + 5
        while http.get("/health?require=any").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = http.get("/health")
        assert r.status_code == 503 and "decode-1 (decode): starting" in r.json()["workers"]
        assert http.get("/health?require=bogus").status_code in (400, 422)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_worker_id_defaults_to_role_and_hostname(monkeypatch):
    import socket

    from server.launch.args import parse_args
    from server.launch.cli import worker_id

    monkeypatch.setattr(socket, "gethostname", lambda: "3f2a9c1d0b7e")
    args = parse_args(["worker", "--role", "decode", "--control-addr", "tcp://0.0.0.0:29500"])
    assert args.worker_id is None and worker_id(args.role, args.worker_id) == "decode-3f2a9c1d0b7e"
    assert worker_id("decode", "decode-0") == "decode-0"
