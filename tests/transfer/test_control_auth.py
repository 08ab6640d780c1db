"""The control plane's CURVE authentication (``transfer.control_auth``, ``transfer.cluster_key``),
on a real worker control socket (``ControlIO``) in this process: the key file round-trips and is
refused with a reason when damaged; a peer with the cluster key is served, and a peer without it,
with another key, or with its own key pair but the server's public key gets no message through,
while both sides log why, naming ``--cluster-key``."""

from __future__ import annotations

import logging
import os
import stat
import time

import pytest
import zmq
import zmq.auth

from server.worker.control_io import ControlIO
from transfer.cluster_key import (
    ClusterKey,
    ClusterKeyError,
    key_file_text,
    parse_key_text,
    read_key_file,
    write_key_file,
)
from transfer.control_auth import (
    CONNECT_TIMEOUT_MS,
    ENV_SECRET,
    ControlAuth,
    ControlAuthError,
    LogThrottle,
    resolve_auth,
)
from transfer.wire.protocol import AbortRequest, StatsRequest, WorkerStats, decode, encode


# ---- key file --------------------------------------------------------------------------------
def test_key_file_round_trips_with_mode_0600_and_is_a_zeromq_certificate(tmp_path):
    key = ClusterKey.generate()
    path = tmp_path / "cluster.key"
    write_key_file(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path) == key
    assert zmq.auth.load_certificate(path) == (key.public, key.secret)  # pyzmq/czmq read the same file
    with pytest.raises(FileExistsError):
        write_key_file(path, ClusterKey.generate())
    other = ClusterKey.generate()
    path.chmod(0o644)
    write_key_file(path, other, overwrite=True)
    assert read_key_file(path) == other and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_damaged_key_files_are_refused_with_the_reason(tmp_path):
    key, other = ClusterKey.generate(), ClusterKey.generate()
    text = key_file_text(key)
    with pytest.raises(ClusterKeyError, match="no secret-key line"):
        parse_key_text(text.replace("secret-key", "# secret"), "f")
    with pytest.raises(ClusterKeyError, match="40 Z85 characters, got 39"):
        parse_key_text(text.replace(key.secret.decode(), key.secret.decode()[:-1]), "f")
    with pytest.raises(ClusterKeyError, match="not the secret-key's public key"):
        parse_key_text(text.replace(key.public.decode(), other.public.decode()), "f")
    with pytest.raises(ClusterKeyError, match="No such file.*pdserve keygen"):
        read_key_file(tmp_path / "missing.key")
    assert key.secret.decode() not in repr(key) and key.fingerprint in repr(key)


def test_resolve_auth_needs_a_key_or_an_explicit_insecure_flag(tmp_path):
    key = ClusterKey.generate()
    path = tmp_path / "k"
    write_key_file(path, key)
    with pytest.raises(ControlAuthError, match="no cluster key: make one with 'pdserve keygen FILE'.*--cluster-key"):
        resolve_auth(None, False, {})
    assert resolve_auth(None, True, {}) == ControlAuth.insecure()
    assert resolve_auth(str(path), False, {}).key == key
    assert resolve_auth(str(path), True, {}).key == key  # a key wins over --insecure-control-plane
    assert resolve_auth(None, False, {ENV_SECRET: key.secret.decode()}).key == key
    with pytest.raises(ControlAuthError, match="both --cluster-key"):
        resolve_auth(str(path), False, {ENV_SECRET: key.secret.decode()})
    with pytest.raises(ControlAuthError, match=ENV_SECRET):
        resolve_auth(None, False, {ENV_SECRET: "too short"})


def test_log_throttle_says_how_many_lines_it_skipped(caplog):
    throttle = LogThrottle(every_s=0.2)
    with caplog.at_level(logging.ERROR, logger="transfer.control_auth"):
        for _ in range(5):
            throttle.log(logging.ERROR, "refused")
        time.sleep(0.25)
        throttle.log(logging.ERROR, "refused")
    assert [r.getMessage() for r in caplog.records] == ["refused", "refused (4 more like it in the last 0s)"]


# ---- a worker control socket under CURVE ------------------------------------------------------
def stats():
    return WorkerStats(worker_id="w", role="decode", model="m", capacity_tokens=1, max_model_len=1, page_size=1)


@pytest.fixture
def worker():
    """A secured ``ControlIO`` (the cluster key) answering heartbeats; yields (ctx, io, addr, auth)."""
    ctx = zmq.Context()
    auth = ControlAuth(ClusterKey.generate())
    io = ControlIO(ctx, "tcp://127.0.0.1:0", stall_limit_s=30, auth=auth)
    io.publish(stats())
    io.start()
    yield ctx, io, io.router.getsockopt(zmq.LAST_ENDPOINT).decode(), auth
    io.close()
    ctx.term()  # every socket of the auth machinery (ZAP, monitors) was closed: term returns


def peer(ctx, addr: str, auth: ControlAuth, raw: dict | None = None):
    """A DEALER to ``addr`` that tries to connect once (no reconnection): configured by ``auth``, or by
    raw CURVE options ``raw``."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.reconnect_ivl = -1
    watch = auth.client(s, "test peer") if raw is None else None
    for k, v in (raw or {}).items():
        setattr(s, k, v)
    s.connect(addr)
    return s, watch


def send(s, frames: list[bytes]) -> None:
    """Queue ``frames`` unless the socket has no connection left to queue them on (its only attempt
    was already refused: a DEALER without a peer would block)."""
    try:
        s.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_the_cluster_key_is_served(worker):
    ctx, io, addr, auth = worker
    s, watch = peer(ctx, addr, auth)
    s.send_multipart(encode(StatsRequest(nonce=5)))
    assert s.poll(5000) and decode(s.recv_multipart())[0].nonce == 5
    assert watch.error is None
    s.close()


def outsiders(auth: ControlAuth) -> dict[str, tuple[ControlAuth, dict | None]]:
    mine = ClusterKey.generate()
    return {
        "no key": (ControlAuth.insecure(), None),
        "another cluster key": (ControlAuth(ClusterKey.generate()), None),
        # knows the worker's public key but holds its own pair: only the ZAP handler stops it
        "own pair, server's public key": (
            ControlAuth.insecure(),
            {"curve_serverkey": auth.key.public, "curve_publickey": mine.public, "curve_secretkey": mine.secret},
        ),
    }


@pytest.mark.parametrize("who", ["no key", "another cluster key", "own pair, server's public key"])
def test_a_peer_without_the_cluster_key_gets_nothing_through_and_both_sides_say_why(worker, who, caplog):
    ctx, io, addr, auth = worker
    other_auth, raw = outsiders(auth)[who]
    with caplog.at_level(logging.ERROR, logger="transfer.control_auth"):
        s, watch = peer(ctx, addr, other_auth, raw)
        send(s, encode(StatsRequest(nonce=9)))
        send(s, encode(AbortRequest(rids=["victim"])))
        assert not s.poll(1500), "an unauthenticated peer got an answer"
        assert not io.scheduler_end.poll(0), "an unauthenticated peer's message reached the scheduler"
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if "refused a control connection" in r.getMessage()]:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    server_side = [r.getMessage() for r in caplog.records if "refused a control connection" in r.getMessage()]
    assert all("--cluster-key" in m for m in server_side), server_side
    if watch is not None:  # our own client socket: it knows why
        assert watch.error is not None and "--cluster-key" in watch.error, watch.error
    s.close()
    assert io.refused_connections == 1  # one attempt, one refusal (pdserve_worker_refused_control_connections)
    # the worker still serves the cluster key afterwards
    good, _ = peer(ctx, addr, auth)
    good.send_multipart(encode(StatsRequest(nonce=11)))
    assert good.poll(5000) and decode(good.recv_multipart())[0].nonce == 11
    good.close()
    assert io.refused_connections == 1


def test_an_insecure_worker_tells_a_keyed_client_why(caplog):
    ctx = zmq.Context()
    io = ControlIO(ctx, "tcp://127.0.0.1:0", auth=ControlAuth.insecure())
    io.publish(stats())
    io.start()
    try:
        s, watch = peer(ctx, io.router.getsockopt(zmq.LAST_ENDPOINT).decode(), ControlAuth(ClusterKey.generate()))
        s.send_multipart(encode(StatsRequest()))
        assert not s.poll(1000)
        assert watch.error is not None and "plain ZMTP" in watch.error and "--cluster-key" in watch.error
        s.close()
    finally:
        io.close()
        ctx.term()


@pytest.mark.parametrize("keyed", [True, False])
def test_every_client_socket_bounds_one_connect_attempt(keyed):
    """A vanished host answers no SYN; the bound makes libzmq retry (resolving the name again)
    after seconds instead of the kernel's ~2 minutes of SYN retries."""
    ctx = zmq.Context()
    auth = ControlAuth(ClusterKey.generate()) if keyed else ControlAuth.insecure()
    sock = ctx.socket(zmq.DEALER)
    try:
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == 0  # libzmq's default: no bound
        auth.client(sock, "test client")
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == CONNECT_TIMEOUT_MS == 2000
    finally:
        sock.close(0)
        ctx.destroy(0)


def test_one_secure_server_per_context():
    ctx = zmq.Context()
    auth = ControlAuth(ClusterKey.generate())
    io = ControlIO(ctx, "tcp://127.0.0.1:0", auth=auth)
    try:
        with pytest.raises(RuntimeError, match="a ZAP handler already serves this ZMQ context"):
            ControlIO(ctx, "tcp://127.0.0.1:0", auth=auth)
    finally:
        io.close()
        ctx.destroy(0)


def test_keygen_writes_a_key_the_worker_accepts(tmp_path, capsys):
    from server.launch.cli import main

    path = tmp_path / "cluster.key"
    assert main(["keygen", str(path)]) == 0
    key = read_key_file(path)
    assert key.fingerprint in capsys.readouterr().out
    assert main(["keygen", str(path)]) == 1 and "--force" in capsys.readouterr().err
    assert read_key_file(path) == key
    assert main(["keygen", "-"]) == 0 and parse_key_text(capsys.readouterr().out, "stdout") != key
    assert os.stat(path).st_mode & 0o077 == 0


# ---- the launch's key -------------------------------------------------------------------------
def test_a_launch_of_everything_makes_an_ephemeral_key_for_its_workers_env(tmp_path):
    from configs.schema import PdserveConfig
    from server.launch.launch_auth import launch_auth

    cfg = PdserveConfig()
    auth, env = launch_auth(cfg, own_workers=True, environ={})
    assert auth.secure and env == {ENV_SECRET: auth.key.secret.decode()}
    assert launch_auth(cfg, own_workers=True, environ={})[0].key != auth.key  # one per launch
    with pytest.raises(ControlAuthError, match="no cluster key"):  # a split launch must share a key
        launch_auth(cfg, own_workers=False, environ={})
    write_key_file(tmp_path / "k", key := ClusterKey.generate())
    given = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"cluster_key": str(tmp_path / "k")})})
    assert launch_auth(given, own_workers=True, environ={}) == (ControlAuth(key), {})  # children read the file
    insecure = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"insecure_control_plane": True})})
    assert launch_auth(insecure, own_workers=True, environ={}) == (ControlAuth.insecure(), {})


def test_a_split_launch_without_a_key_fails_before_starting_anything(capsys, monkeypatch):
    import asyncio

    from configs.schema import PdserveConfig
    from server.launch.launcher import Launcher

    monkeypatch.delenv(ENV_SECRET, raising=False)
    launcher = Launcher(PdserveConfig(), roles=frozenset({"decode"}), install_signals=False)
    assert asyncio.run(launcher.run()) == 1
    err = capsys.readouterr().err
    assert "no cluster key" in err and "--cluster-key" in err and "--insecure-control-plane" in err
