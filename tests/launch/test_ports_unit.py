"""Units of the launch's ports: worker port reservation, the restart back-off policy, and the
cluster id that keeps a router or a decode worker from using another deployment's worker."""

from __future__ import annotations

import pytest

from bench.harness.subprocess_server import free_port
from configs.schema import PdserveConfig
from decode_worker.peers import PrefillPeers
from prefill_worker.kv_sender import KVSender
from server.launch.ports import PortUnavailable, listen, reserve_worker_ports, suggest_base_port
from server.launch.roles import worker_specs
from server.launch.supervisor import RestartPolicy
from server.router.inflight import InflightTable
from server.router.registry import READY, STARTING, Registry, WorkerSpec
from transfer.wire.protocol import KVHandshake, KVHandshakeAck, WorkerStats


def pd_cfg(base: int) -> PdserveConfig:
    return PdserveConfig.model_validate({"cluster": {"mode": "pd", "prefill": 1, "decode": 2, "base_port": base}})


def test_reserve_holds_every_port_and_a_busy_one_names_port_worker_and_flag():
    base = suggest_base_port("127.0.0.1", 3, free_port())
    cfg = pd_cfg(base)
    held = reserve_worker_ports(worker_specs(cfg), cfg)
    try:
        assert sorted(held) == ["decode-0", "decode-1", "prefill-0"]
        with pytest.raises(OSError):
            listen("127.0.0.1", base + 2)
        with pytest.raises(PortUnavailable) as e:  # a second launch with the same base port
            reserve_worker_ports(worker_specs(cfg), cfg)
    finally:
        for s in held.values():
            s.close()
    msg = str(e.value)
    assert f"worker prefill-0 (prefill) control port 127.0.0.1:{base}" in msg, msg
    assert f"need ports {base}-{base + 2} (--base-port {base}): choose another --base-port" in msg, msg
    listen("127.0.0.1", base).close()  # nothing stays bound after the failure or the close


def test_busy_message_suggests_a_base_port_that_is_free():
    blocker = listen("127.0.0.1", 0)
    try:
        base = blocker.getsockname()[1]
        cfg = pd_cfg(base)
        with pytest.raises(PortUnavailable) as e:
            reserve_worker_ports(worker_specs(cfg), cfg)
        free = int(str(e.value).rsplit("--base-port ", 1)[1].split()[0])
        assert free > base + 2
        cfg2 = pd_cfg(free)
        for s in reserve_worker_ports(worker_specs(cfg2), cfg2).values():
            s.close()
    finally:
        blocker.close()


def test_restart_policy_doubles_caps_gives_up_and_resets_when_ready():
    p = RestartPolicy(limit=4, base_s=1.0, max_s=3.0)
    delays = [p.on_exit("w", 100.0) for _ in range(5)]
    assert delays == [1.0, 2.0, 3.0, 3.0, None]
    assert p.pop_due(102.9) == [] and p.pop_due(103.0) == ["w"] and p.pop_due(200.0) == []
    p.ready("w")
    assert p.attempt("w") == 0 and p.on_exit("w", 0.0) == 1.0
    off = RestartPolicy.from_config(PdserveConfig.model_validate({"cluster": {"restart_workers": False}}).cluster)
    assert off.on_exit("w", 0.0) is None


def stats(wid: str, role: str, cluster: str, instance: str = "i1") -> WorkerStats:
    return WorkerStats(
        worker_id=wid,
        role=role,
        cluster_id=cluster,
        instance=instance,
        model="m",
        capacity_tokens=10,
        max_model_len=10,
        page_size=1,
    )


class _Client:
    def __init__(self, *_):
        pass


def test_router_never_routes_to_another_clusters_worker():
    reg = Registry(
        [WorkerSpec("prefill-0", "prefill", "tcp://127.0.0.1:1")],
        _Client,
        InflightTable(),
        model_name="m",
        cluster_id="aaa",
    )
    reg.on_stats("prefill-0", stats("colocated-0", "colocated", "bbb"))
    h = reg.handles["prefill-0"]
    assert h.state == STARTING
    assert "colocated-0 (colocated) of cluster 'bbb', but this router's cluster is 'aaa'" in h.reason
    reg.on_stats("prefill-0", stats("prefill-0", "colocated", "aaa"))
    assert h.state == STARTING and h.reason == "answers as a colocated worker (prefill-0), expected prefill"
    reg.on_stats("prefill-0", stats("prefill-0", "prefill", "aaa"))
    assert h.state == READY


def test_decode_refuses_a_foreign_worker_at_its_prefill_address_and_recovers():
    hs = KVHandshake(
        worker_id="decode-0", cluster_id="aaa", model="m", layout={}, transport="nixl", transport_metadata=""
    )
    peers = PrefillPeers(hs, timeout_s=10.0, progress_timeout_s=60.0)
    addr = "tcp://127.0.0.1:1"
    peers.connect(addr)
    peers.on_message(addr, stats("colocated-0", "colocated", "bbb"))
    peer = peers.get(addr)
    assert peer.unusable and "colocated-0 (colocated) of cluster 'bbb'" in peer.error
    assert "decode-0" in peer.error and "'aaa'" in peer.error
    out = peers.on_message(addr, stats("prefill-0", "prefill", "aaa"))  # its own worker is back there
    assert [type(m.msg) for m in out.messages] == [KVHandshake]
    peers.on_message(addr, KVHandshakeAck(ok=True, worker_id="prefill-0"))
    assert peers.get(addr).ready


def test_prefill_refuses_a_handshake_from_another_cluster():
    sender = KVSender(transport=None, unit_bytes=1, threaded=False)  # refused before the transport is used
    hs = KVHandshake(
        worker_id="decode-0", cluster_id="bbb", model="m", layout={}, transport="nixl", transport_metadata=""
    )
    err = sender.accept_peer(None, hs, "m", {}, cluster_id="aaa", worker_id="prefill-0")
    assert err.startswith(
        "cluster mismatch: decode worker decode-0 belongs to cluster 'bbb', this prefill worker prefill-0 to 'aaa'"
    ), err
    assert sender.peers == {}


def test_launch_gets_a_random_cluster_id_only_when_it_runs_everything():
    from server.launch.launcher import Launcher

    cfg = PdserveConfig()
    a, b = Launcher(cfg).cfg.cluster.cluster_id, Launcher(cfg).cfg.cluster.cluster_id
    assert a and b and a != b
    assert Launcher(cfg, roles=frozenset({"router", "prefill"})).cfg.cluster.cluster_id == ""
    given = PdserveConfig.model_validate({"cluster": {"cluster_id": "prod"}})
    assert Launcher(given, roles=frozenset({"decode"})).cfg.cluster.cluster_id == "prod"
