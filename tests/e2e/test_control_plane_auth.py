"""The authenticated control plane with real processes.

A ``pdserve launch --mode pd`` makes an ephemeral cluster key and hands it to its workers in their
environment (never on a command line). Against its prefill and decode workers:

- peers without the key (no key; another cluster key; their own key pair with the worker's public
  key) send one message of every kind in ``transfer.wire.protocol.MESSAGES`` (``Shutdown``,
  ``GenerateRequest``, ``AbortRequest``, ``StatsRequest``, ...): none is answered or accepted (no
  worker counter moves, no process exits), each refusal is logged naming ``--cluster-key`` and
  counted (``pdserve_worker_refused_control_connections_total``: one per attempt), and the
  cluster keeps serving;
- a peer with the launch's key (read from a worker's environment, as its own user can) is answered;
- a router given another key shows the refused handshake, naming ``--cluster-key``, in ``/health``;
- a worker with no key refuses to start (before loading the model) unless
  ``--insecure-control-plane``, and then warns that it runs unauthenticated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

from bench.harness.subprocess_server import REPO_ROOT, free_port, fresh_metrics
from tests.support.servers import PD_SERVER_HEARTBEAT_S
from transfer.cluster_key import ClusterKey, write_key_file
from transfer.control_auth import ENV_SECRET, ControlAuth
from transfer.wire.enums import Role
from transfer.wire.protocol import (
    MESSAGES,
    AbortRequest,
    Drain,
    GenerateRequest,
    KVDestination,
    KvEvents,
    KVHandshake,
    KVHandshakeAck,
    KvSnapshot,
    KvSnapshotRequest,
    KVSources,
    KVWriteStarted,
    MigrateRequest,
    MigrationDeclined,
    MigrationEnded,
    MigrationOffer,
    PrefilledLocally,
    PrefillFailed,
    PrefillRequest,
    PrefillWithdrawn,
    QueuedMove,
    QueuedOffer,
    RoleSwitched,
    Shutdown,
    StatsRequest,
    SwitchRole,
    TokenBatch,
    TokenDelta,
    WorkerStats,
    decode,
    encode,
    hashes_frame,
    ids_frame,
)
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.process

HEARTBEAT_S = PD_SERVER_HEARTBEAT_S
COUNTERS = (
    "pdserve_prompt_tokens_total",
    "pdserve_generation_tokens_total",
    "pdserve_worker_finished_requests_total",
    "pdserve_worker_aborted_requests_total",
    "pdserve_worker_rejected_requests_total",
    "pdserve_kv_transfer_bytes_total",
    "pdserve_transfer_failures_total",
)


def every_message_kind() -> dict[str, list[bytes]]:
    """One well-formed message of every kind the protocol knows, as an attacker would send it."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    stats = WorkerStats(worker_id="evil", role="decode", model="m", capacity_tokens=1, max_model_len=1, page_size=16)
    out = {
        "GenerateRequest": encode(GenerateRequest(rid="evil-gen", params=params), ids_frame([1, 2, 3])),
        "PrefillRequest": encode(
            PrefillRequest(rid="evil-pre", room=7, params=params, decode_worker="decode-0"), ids_frame([1, 2, 3])
        ),
        "KVHandshake": encode(
            KVHandshake(worker_id="evil", model="m", layout={}, transport="nixl", transport_metadata="")
        ),
        "KVHandshakeAck": encode(KVHandshakeAck(ok=True, worker_id="evil")),
        "KVDestination": encode(
            KVDestination(rid="evil-pre", room=7, generation=0, decode_prefix_len=0, n_tokens=3),
            ids_frame([0]),
            ids_frame([]),
        ),
        "PrefillFailed": encode(PrefillFailed(rid="evil-gen", room=7, generation=0, error="x")),
        # a prefill worker would drop the request silently (its decode worker "prefills it itself")
        "PrefillWithdrawn": encode(PrefillWithdrawn(rid="evil-pre", room=7)),
        # a decode worker would start polling its transport for a landing that never comes
        "KVWriteStarted": encode(KVWriteStarted(rid="evil-pre", room=7, generation=0)),
        "AbortRequest": encode(AbortRequest(rids=["evil-gen", "evil-pre"])),
        "StatsRequest": encode(StatsRequest(nonce=66)),
        "TokenBatch": encode(*TokenBatch.pack([TokenDelta(rid="evil-gen", token_ids=[1])])),
        "WorkerStats": encode(stats),
        "Shutdown": encode(Shutdown()),
        "Drain": encode(Drain(reason="evil")),  # accepted, it would take the worker out of rotation
        "KvSnapshotRequest": encode(KvSnapshotRequest(reason="evil")),
        "KvEvents": encode(
            KvEvents(worker_id="evil", instance="x", seq=1, pool="full", kinds=["cleared"], counts=[0]),
            hashes_frame([]),
        ),
        "KvSnapshot": encode(KvSnapshot(worker_id="evil", instance="x", seq=1, pool="full"), hashes_frame([1])),
        # a decode worker would admit the request and write KV for it from an address the attacker names
        "MigrateRequest": encode(
            MigrateRequest(
                rid="evil-mig",
                params=SamplingParams(max_new_tokens=4),
                room=9,
                source_addr="tcp://127.0.0.1:9",
                prompt_len=2,
                n_tokens=3,
            ),
            ids_frame([1, 2, 3]),
        ),
        "MigrationOffer": encode(
            MigrationOffer(rid="evil-gen", n_tokens=3, pages=1, prompt_len=2, params=SamplingParams(max_new_tokens=4)),
            ids_frame([1, 2, 3]),
        ),
        "MigrationDeclined": encode(MigrationDeclined(rid="evil-gen", reason="evil")),
        "MigrationEnded": encode(MigrationEnded(rid="evil-gen", ok=False, error="evil")),
        "QueuedOffer": encode(QueuedOffer(rid="evil-gen", pages=1, waited_s=1.0)),
        # a decode worker would drop the queued request silently and withdraw its prefill
        "QueuedMove": encode(QueuedMove(rid="evil-gen", target="decode-1")),
        # a decode worker would handshake the attacker's address as a KV source
        "KVSources": encode(KVSources(prefill=["tcp://127.0.0.1:9"], decode=["tcp://127.0.0.1:10"])),
        # a worker would evacuate its requests and serve in the other role
        "SwitchRole": encode(SwitchRole(role=Role.PREFILL)),
        "RoleSwitched": encode(RoleSwitched(ok=True, role=Role.PREFILL, instance="evil")),
        # a router would stop failing the stream over when its prefill worker dies
        "PrefilledLocally": encode(PrefilledLocally(rid="evil-gen")),
    }
    assert set(out) == set(MESSAGES), "a new message kind: add it here so the attack sends it too"
    return out


def worker_procs(srv) -> dict[str, tuple[int, str]]:
    """{worker id: (pid, control address)} of the launch's worker processes."""
    out = {}
    for pid in srv.worker_pids():
        cmd = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        if "--worker-id" in cmd:
            out[cmd[cmd.index("--worker-id") + 1]] = (pid, cmd[cmd.index("--control-addr") + 1])
    return out


def counters(url: str) -> dict:
    m = fresh_metrics(url, HEARTBEAT_S)
    return {k: v for k, v in m.items() if k[0] in COUNTERS}


@pytest.fixture(scope="module")
def server(pd_server):
    """The session's default PD launch (conftest ``pd_server``; its heartbeat is ``HEARTBEAT_S``)."""
    return pd_server


@pytest.fixture(scope="module")
def launch_key(server) -> ClusterKey:
    """The launch's ephemeral key, from a worker's environment (readable by the launch's own user only)."""
    pid, _ = next(iter(worker_procs(server).values()))
    env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return ClusterKey.from_secret(env[ENV_SECRET.encode()])


def complete(url: str) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        trust_env=False,
        json={
            "model": httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"],
            "prompt": "The capital of France is",
            "max_tokens": 6,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_ephemeral_key_is_on_no_command_line(server, launch_key):
    secret = launch_key.secret
    for pid in [server.pid, *server.worker_pids()]:
        assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert oct(os.stat(f"/proc/{server.worker_pids()[0]}/environ").st_mode & 0o777) == "0o400"


def attackers(key: ClusterKey) -> dict[str, dict]:
    own = ClusterKey.generate()
    return {
        "no key": {},
        "another cluster key": {
            "curve_serverkey": own.public,
            "curve_publickey": own.public,
            "curve_secretkey": own.secret,
        },
        "own pair, the worker's public key": {
            "curve_serverkey": key.public,
            "curve_publickey": own.public,
            "curve_secretkey": own.secret,
        },
    }


def refused_counts(url: str) -> dict[str, float]:
    m = fresh_metrics(url, HEARTBEAT_S)
    name = "pdserve_worker_refused_control_connections_total"
    return {dict(lab)["worker"]: v for (n, lab), v in m.items() if n == name}


def test_no_message_of_an_unauthenticated_peer_is_accepted(server, launch_key):
    before_pids = worker_procs(server)
    before, refused_before = counters(server.url), refused_counts(server.url)
    ctx = zmq.Context()
    socks = []
    try:
        for options in attackers(launch_key).values():
            for _, addr in before_pids.values():
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                s.reconnect_ivl = -1  # one connection attempt each: the refusals can be counted exactly
                for k, v in options.items():
                    setattr(s, k, v)
                s.connect(addr)
                for frames in every_message_kind().values():
                    try:  # NOBLOCK: once its one attempt was refused, a DEALER has no peer and would block
                        s.send_multipart(frames, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                socks.append(s)
        time.sleep(3)  # every handshake was tried (and retried) many times meanwhile
        assert [s.poll(0) for s in socks] == [0] * len(socks), "an unauthenticated peer got an answer"
    finally:
        ctx.destroy(0)
    assert worker_procs(server) == before_pids, "a worker process exited or restarted"
    assert counters(server.url) == before, "an unauthenticated message moved a worker counter"
    n = len(attackers(launch_key))
    assert refused_counts(server.url) == {wid: v + n for wid, v in refused_before.items()}
    assert httpx.get(f"{server.url}/health", trust_env=False).status_code == 200
    assert complete(server.url)
    log = server.log()
    for wid, (_, addr) in before_pids.items():
        refused = [line for line in log.splitlines() if "refused a control connection" in line and addr in line]
        assert refused, (wid, log[-3000:])
        assert [line for line in refused if "--cluster-key" not in line] == []
    zap = [line for line in log.splitlines() if "its CURVE key is not this cluster's" in line]
    assert zap and "127.0.0.1" in zap[0]  # the ZAP handler names the peer's address


def test_the_launch_key_is_answered(server, launch_key):
    ctx = zmq.Context()
    try:
        for wid, (_, addr) in worker_procs(server).items():
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            ControlAuth(launch_key).client(s, "test")
            s.connect(addr)
            s.send_multipart(encode(StatsRequest(nonce=5)))
            assert s.poll(10_000), f"{wid} did not answer the launch's key"
            msg, _ = decode(s.recv_multipart())
            assert isinstance(msg, WorkerStats) and (msg.worker_id, msg.nonce) == (wid, 5)
    finally:
        ctx.destroy(0)


def test_a_router_with_another_key_says_why_in_health(server, tmp_path):
    write_key_file(tmp_path / "wrong.key", ClusterKey.generate())
    port = free_port()
    workers = [f"--worker={wid.split('-')[0]}={wid}={addr}" for wid, (_, addr) in worker_procs(server).items()]
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.launch.cli",
            "router",
            "--port",
            str(port),
            "--cluster-key",
            str(tmp_path / "wrong.key"),
            *workers,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        detail = ""
        while "--cluster-key" not in detail:
            assert router.poll() is None and time.monotonic() < deadline, (detail, router.poll())
            time.sleep(0.5)
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=5)
            except httpx.HTTPError:
                continue
            assert r.status_code == 503
            detail = r.json()["workers"]
        assert "CURVE handshake was cut off" in detail and "starting" in detail, detail
    finally:
        router.terminate()
        _, err = router.communicate(timeout=30)
    assert "cannot talk to" in err and "--cluster-key" in err, err[-2000:]


def worker_cmd(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "server.launch.cli",
        "worker",
        "--role",
        "decode",
        "--worker-id",
        "lone",
        "--control-addr",
        f"tcp://127.0.0.1:{port}",
        "--kv-pool-tokens",
        "256",
        *flags,
    ]


def test_a_worker_without_a_key_refuses_to_start_unless_insecure():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_CLUSTER")}
    t0 = time.monotonic()
    r = subprocess.run(worker_cmd(free_port()), cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "refusing to start: no cluster key" in r.stderr, r.stderr
    assert "--cluster-key" in r.stderr and "--insecure-control-plane" in r.stderr
    print(f"\n[auth] keyless worker refused in {time.monotonic() - t0:.1f}s")
    port = free_port()
    p = subprocess.Popen(
        worker_cmd(port, "--insecure-control-plane"),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send_multipart(encode(StatsRequest(nonce=3)))
        assert s.poll(180_000), "the insecure worker never answered"
        assert decode(s.recv_multipart())[0].worker_id == "lone"
        ctx.destroy(0)
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "control plane NOT authenticated (--insecure-control-plane)" in err, err[-2000:]
