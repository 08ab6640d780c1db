"""Deterministic in-process PD pair: a prefill and a decode scheduler wired by direct message
delivery (no sockets) and the loopback KV transport. For unit tests and benchmarks; the real path
(processes, ZMQ, NIXL) is covered by the process-level tests."""
from __future__ import annotations

import itertools

from cache.host_pool import HostKVPool
from configs.schema import PdserveConfig
from decode_worker.peers import make_handshake
from decode_worker.scheduler import DecodeScheduler
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams
from prefill_worker.kv_sender import KVSender
from prefill_worker.scheduler import PrefillScheduler
from transfer.loopback import LoopbackTransport
from transfer.protocol import PrefillFailed, TokenBatch

_names = itertools.count()


class _Peer:
    def __init__(self, addr):
        self.addr, self.state, self.error, self.worker_id = addr, "ready", None, "p0"

    @property
    def ready(self):
        return self.state == "ready"


class FakePeers:
    """Stands in for ``PrefillPeers``: delivers decode -> prefill messages synchronously."""

    def __init__(self, harness, handshake):
        self.h, self.handshake, self.peer = harness, handshake, None

    def get(self, addr):
        if self.peer is None:
            self.peer = _Peer(addr)
            self.h.prefill.handle(b"d0", self.handshake, [])
        return self.peer

    def send(self, peer, msg, *frames):
        self.h.prefill.handle(b"d0", msg, list(frames))

    def sockets(self):
        return []

    def on_message(self, source, msg):
        return self.peer

    def tick(self):
        return []

    def restarted(self):
        return []


class PDHarness:
    def __init__(self, cfg_p: PdserveConfig, cfg_d: PdserveConfig, model_config, weights, eos=()):
        n = next(_names)
        self.p_runner = ModelRunner(cfg_p.engine, model_config, weights)
        self.d_runner = ModelRunner(cfg_d.engine, model_config, weights)
        tp, td = LoopbackTransport(f"p{n}"), LoopbackTransport(f"d{n}")
        tp.register_pool(self.p_runner.pool.buffer, self.p_runner.pool.page_bytes)
        td.register_pool(self.d_runner.pool.buffer, self.d_runner.pool.page_bytes)
        self.transports = (tp, td)
        self.to_decode: list = []
        self.router_inbox: list = []
        sender = KVSender(tp, self.p_runner.pool.page_bytes, self._p_send, threaded=False)
        self.prefill = PrefillScheduler(self.p_runner, cfg_p, sender, self._p_send, "m", "p0")
        host = None
        if cfg_d.cluster.host_kv_pool_gb > 0:
            host = HostKVPool.for_device_pool(self.d_runner.pool.buffer, int(cfg_d.cluster.host_kv_pool_gb * 2**30))
        hs = make_handshake("d0", "m", self.d_runner.pool.layout_descriptor(), td)
        self.decode = DecodeScheduler(self.d_runner, cfg_d, td, None, host, eos, "d0")
        self.decode.peers = FakePeers(self, hs)
        self.room = itertools.count(1)

    def _p_send(self, ident, msg, *frames):
        if ident == b"router":
            self.router_inbox.append(msg)
        elif isinstance(msg, (PrefillFailed,)) or not isinstance(msg, TokenBatch):
            self.to_decode.append((msg, list(frames)))

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        from transfer.protocol import PrefillRequest, ids_frame

        room = next(self.room)
        self.decode.add_request(rid, prompt, params, room=room, prefill_addr="inproc://p")
        self.prefill.handle(b"router", PrefillRequest(rid=rid, room=room, params=params, decode_worker="d0"),
                            [ids_frame(prompt)])

    def step(self) -> list:
        self.prefill.step()
        while self.to_decode:
            msg, frames = self.to_decode.pop(0)
            self.decode.handle(object(), msg, frames)
        return self.decode.step()

    @property
    def busy(self) -> bool:
        return bool(self.decode.jobs or self.prefill.jobs or self.to_decode)

    def run(self, max_steps: int = 10000) -> dict:
        out: dict[str, dict] = {}
        for _ in range(max_steps):
            if not self.busy:
                break
            for ev in self.step():
                o = out.setdefault(ev.rid, {"tokens": [], "finish": None, "error": None})
                o["tokens"] += ev.token_ids
                if ev.finish_reason:
                    o["finish"], o["error"] = ev.finish_reason, ev.error
        assert not self.busy, "PD harness did not drain"
        return out

    def check_clean(self) -> None:
        for s in (self.prefill, self.decode):
            s.check_integrity()
            assert s.kv.usage([]).used == 0
        host = self.decode.retract.host
        if host is not None:
            assert host.num_free() == host.num_pages

    def close(self) -> None:
        self.prefill.sender.close()
        for t in self.transports:
            t.close()
