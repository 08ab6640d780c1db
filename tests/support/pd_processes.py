"""PD across real processes for tests: ``PDPair`` runs a prefill and a decode worker
(``server.worker.main``) as subprocesses on the tiny model and talks to them as the router does;
``wait_idle``, ``until_eos`` and the prompts its tests share."""

from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
import time

import zmq

from configs.schema import PdserveConfig
from server.launch.ports import listen
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ENV_SECRET, ControlAuth
from transfer.wire.protocol import (
    GenerateRequest,
    PrefillRequest,
    Shutdown,
    StatsRequest,
    TokenBatch,
    WorkerStats,
    decode,
    encode,
    ids_frame,
)


def held_port() -> socket.socket:
    """A listening socket on a free loopback port, handed to the worker (``--listen-fd``) as the
    launcher does: a port picked, closed and bound again later can be taken in between."""
    return listen("127.0.0.1", 0)


class PDPair:
    """One prefill and one decode worker process plus a DEALER to each (the router's role)."""

    def __init__(
        self,
        model_dir,
        decode_pool: int,
        host_gb: float,
        decode_page_size: int = 4,
        backend: str = "nixl",
        decode_backend: str | None = None,
        cluster: dict | None = None,
        prefill_sched: dict | None = None,
        decode_sched: dict | None = None,
        engine: dict | None = None,
        **sched,
    ):
        """``cluster`` updates both workers' cluster section, ``engine`` their engine section;
        ``prefill_sched``/``decode_sched`` one worker's scheduler section (``sched``: both)."""
        self.cfg = PdserveConfig.model_validate(
            {
                "engine": {
                    "model": str(model_dir),
                    "page_size": 4,
                    "kv_pool_tokens": 4096,
                    "dtype": "float32",  # the exact mode the references are in
                    **(engine or {}),
                },
                "scheduler": sched,
                "server": {"health_interval_s": 0.5},
                "cluster": {
                    "mode": "pd",
                    "host_kv_pool_gb": host_gb,
                    "peer_timeout_s": 2.0,
                    "transfer_fence_s": 3.0,
                    "transfer_backend": backend,
                    **(cluster or {}),
                },
            }
        )
        pcfg = self.cfg.model_copy(update={"scheduler": self.cfg.scheduler.model_copy(update=prefill_sched or {})})
        dcfg = self.cfg.model_copy(deep=True)
        dcfg.scheduler = dcfg.scheduler.model_copy(update=decode_sched or {})
        dcfg.engine.kv_pool_tokens = decode_pool
        dcfg.engine.page_size = decode_page_size
        dcfg.cluster.transfer_backend = decode_backend or backend
        self.held = {wid: held_port() for wid in ("p0", "d0")}
        self.p_addr, self.d_addr = (f"tcp://127.0.0.1:{self.held[w].getsockname()[1]}" for w in ("p0", "d0"))
        self.auth = ControlAuth(ClusterKey.generate())
        self.procs = {
            "p0": self._spawn("prefill", "p0", self.p_addr, pcfg),
            "d0": self._spawn("decode", "d0", self.d_addr, dcfg),
        }
        self.ctx = zmq.Context()
        self.socks = {}
        for wid, addr in (("p0", self.p_addr), ("d0", self.d_addr)):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            self.auth.client(s, f"test driver -> {wid}")
            s.connect(addr)
            self.socks[wid] = s
        self.rooms = itertools.count(1)
        for wid in self.socks:
            assert self.stats(wid, timeout=60).role in ("prefill", "decode")

    def _spawn(self, role, wid, addr, cfg):
        fd = self.held[wid].fileno()
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.worker.main",
                "--role",
                role,
                "--worker-id",
                wid,
                "--control-addr",
                addr,
                "--listen-fd",
                str(fd),
                "--config-json",
                cfg.model_dump_json(),
            ],
            env={**os.environ, ENV_SECRET: self.auth.key.secret.decode()},
            pass_fds=(fd,),
        )

    def stats(self, wid: str, timeout: float = 10) -> WorkerStats:
        s = self.socks[wid]
        s.send_multipart(encode(StatsRequest(nonce=7)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if s.poll(200):
                msg, _ = decode(s.recv_multipart())
                if isinstance(msg, WorkerStats):
                    return msg
        raise TimeoutError(f"{wid} did not answer")

    def submit(self, rid, prompt, params, to_prefill=True):
        room = next(self.rooms)
        self.socks["d0"].send_multipart(
            encode(GenerateRequest(rid=rid, params=params, room=room, prefill_addr=self.p_addr), ids_frame(prompt))
        )
        if to_prefill:
            self.socks["p0"].send_multipart(
                encode(PrefillRequest(rid=rid, room=room, params=params, decode_worker="d0"), ids_frame(prompt))
            )

    def collect(self, rids, timeout=60) -> dict:
        out = {r: {"tokens": [], "finish": None, "error": None} for r in rids}
        deadline = time.monotonic() + timeout
        s = self.socks["d0"]
        while any(o["finish"] is None for o in out.values()):
            assert time.monotonic() < deadline, f"timed out: {out}"
            if not s.poll(200):
                continue
            msg, frames = decode(s.recv_multipart())
            if not isinstance(msg, TokenBatch):
                continue
            for e in msg.unpack(frames[0]):
                out[e.rid]["tokens"] += e.token_ids
                if e.finish_reason:
                    out[e.rid]["finish"], out[e.rid]["error"] = e.finish_reason, e.error
        return out

    def close(self):
        for wid, s in self.socks.items():
            if self.procs[wid].poll() is None:
                s.send_multipart(encode(Shutdown()))
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.ctx.destroy(0)
        for sock in self.held.values():
            sock.close()


def prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(0, 96) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


EOS = 96


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def wait_idle(pair: PDPair, wid: str, timeout=10) -> WorkerStats:
    deadline = time.monotonic() + timeout
    while True:
        st = pair.stats(wid)
        if st.gauges["kv_pages_used"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


# no ignore_eos: admission reserves only max_new_tokens * new_token_ratio, so it overcommits


# a slow decode step lets all four transfers land (and be admitted) before the first request grows:
# without it a quick decode finishes early requests first and the pool may never run short
SLOW_DECODE = {"test_step_delay_s": 0.1}
