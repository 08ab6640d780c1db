"""1 prefill + 2 decode workers and the router's migration logic in one process: the real
schedulers (loopback KV transports, a second one on each decode worker over its host pool), the
router's real ``InflightTable`` and ``Migrations``, and messages delivered by direct calls.

Addresses: a worker reaches another as ``Peer(ADDR[id])``; that arrives at the other's ``handle``
as from ``Conn(id)``, and answers to ``Conn(id)`` come back as from ``Peer(ADDR[other])``.
Anything sent to ``Conn(ROUTER)`` goes to the router part: token batches into the in-flight
table, migration messages into ``Migrations``. Every step hands each decode worker a heartbeat
reply of every peer it knows (``dead`` ones stay silent), as the worker loop's pinger would.
"""

from __future__ import annotations

import itertools
import time

from decode_worker.scheduler import create_decode_scheduler
from engine.model_runner import ModelRunner
from prefill_worker.scheduler import create_prefill_scheduler
from server.router.inflight import InflightTable
from server.router.migration import Migrations
from server.router.workers import READY, WorkerHandle, WorkerSpec
from server.worker.loop import worker_stats
from server.worker.turn import Turns
from transfer.loopback import LoopbackTransport
from transfer.wire.enums import Role
from transfer.wire.outbox import Conn, Outbox, Peer
from transfer.wire.protocol import (
    AbortRequest,
    GenerateRequest,
    MigrateRequest,
    MigrationDeclined,
    MigrationEnded,
    MigrationOffer,
    PrefillRequest,
    StatsRequest,
    frame_ids,
    ids_frame,
)

ROUTER = b"router"
ADDR = {"p0": "inproc://p0", "d1": "inproc://d1", "d2": "inproc://d2"}
BY_ADDR = {a: w for w, a in ADDR.items()}
_names = itertools.count()


class _Client:
    """What the router's ``Migrations`` calls on a worker: delivered to its scheduler as from the router."""

    def __init__(self, h: MigrationHarness, wid: str) -> None:
        self.h, self.wid = h, wid

    def migrate(self, rid, ids, params, room, source_addr, prompt_len, n_tokens, draft=None) -> None:
        msg = MigrateRequest(
            rid=rid,
            params=params,
            room=room,
            source_addr=source_addr,
            prompt_len=prompt_len,
            n_tokens=n_tokens,
            draft=draft,
        )
        self.h.inbox.append((self.wid, Conn(ROUTER), msg, [ids_frame(ids)]))

    def decline_migration(self, rid, reason) -> None:
        self.h.inbox.append((self.wid, Conn(ROUTER), MigrationDeclined(rid=rid, reason=reason), []))

    def abort(self, rids, reason) -> None:
        self.h.inbox.append((self.wid, Conn(ROUTER), AbortRequest(rids=rids, reason=reason), []))


class MigrationHarness:
    def __init__(self, cfg_p, cfg_d1, cfg_d2, model_config, weights) -> None:
        n = next(_names)
        self.transports = []

        def transport(name):
            t = LoopbackTransport(f"{name}-{n}")
            self.transports.append(t)
            return t

        self.runners = {
            w: ModelRunner(c.engine, model_config, weights) for w, c in (("p0", cfg_p), ("d1", cfg_d1), ("d2", cfg_d2))
        }
        self.workers = {
            "p0": create_prefill_scheduler(self.runners["p0"], cfg_p, transport("p0"), "p0", "m", threaded=False)
        }
        for w, c in (("d1", cfg_d1), ("d2", cfg_d2)):
            self.workers[w] = create_decode_scheduler(
                self.runners[w], c, transport(w), w, "m", migration_transport=transport(w + "-mig"), threaded=False
            )
        self.turns = {w: Turns(s) for w, s in self.workers.items()}
        self.table = InflightTable()
        self.handles = {
            w: WorkerHandle(
                WorkerSpec(w, Role.PREFILL if w == "p0" else Role.DECODE, ADDR[w]), _Client(self, w), state=READY
            )
            for w in self.workers
        }
        self.rooms = itertools.count(1)
        self.router = Migrations(self.handles, self.table, lambda: next(self.rooms))
        self.inbox: list = []  # (worker id, source, msg, frames)
        self.dead: set[str] = set()
        self.out: dict[str, dict] = {}
        self.offers = self.ended = 0

    @property
    def d1(self):
        return self.workers["d1"]

    @property
    def d2(self):
        return self.workers["d2"]

    def submit(self, rid: str, prompt: list[int], params, decode: str = "d1") -> None:
        room = next(self.rooms)
        self.table.open(rid, ("p0", decode), decode, len(prompt) + params.max_new_tokens)
        self.deliver(
            decode,
            self.workers[decode].add(
                ROUTER, GenerateRequest(rid=rid, params=params, room=room, prefill_addr=ADDR["p0"]), prompt
            ),
        )
        msg = PrefillRequest(rid=rid, room=room, params=params, decode_worker=decode)
        self.deliver("p0", self.workers["p0"].handle(Conn(ROUTER), msg, [ids_frame(prompt)]))

    def deliver(self, sender: str, out: Outbox | None) -> None:
        """Route ``sender``'s outbox: tokens to the in-flight table, messages to their worker or the router."""
        if out is None:
            return
        for _owner, delta in out.tokens:
            self.table.dispatch(sender, delta)
        for m in out.messages:
            if m.to == Conn(ROUTER):
                self._to_router(sender, m.msg, list(m.frames))
            elif isinstance(m.to, Peer):
                self.inbox.append((BY_ADDR[m.to.addr], Conn(sender.encode()), m.msg, list(m.frames)))
            else:
                self.inbox.append((m.to.ident.decode(), Peer(ADDR[sender]), m.msg, list(m.frames)))

    def _to_router(self, sender: str, msg, frames) -> None:
        if isinstance(msg, MigrationOffer):
            self.offers += 1
            self.router.on_offer(sender, msg, frame_ids(frames[0]))
        elif isinstance(msg, MigrationEnded):
            self.ended += 1
            self.router.on_ended(sender, msg)

    def _exchange(self) -> None:
        while self.inbox:
            wid, source, msg, frames = self.inbox.pop(0)
            if wid in self.dead:
                continue
            s = self.workers[wid]
            if isinstance(msg, StatsRequest):
                continue  # heartbeats are handed over in ``step``
            if isinstance(msg, AbortRequest):
                for rid in msg.rids:
                    self.deliver(wid, s.abort(rid, msg.reason))
            elif isinstance(msg, MigrateRequest) or not isinstance(msg, GenerateRequest):
                self.deliver(wid, s.handle(source, msg, frames))

    def step(self) -> None:
        now = time.monotonic()
        for w, s in self.workers.items():
            if w not in self.dead:
                self.handles[w].stats = worker_stats(s, w, "harness", "m")
        for w in ("d1", "d2"):
            if w in self.dead:
                continue
            for addr in list(self.workers[w].peers.by_addr):
                if BY_ADDR[addr] not in self.dead:
                    self.deliver(w, self.workers[w].peer_heartbeat(addr, self.handles[BY_ADDR[addr]].stats, now))
        self._exchange()
        for w in self.workers:
            if w not in self.dead:
                self.deliver(w, self.turns[w].run().outbox)
                self._exchange()
        self._collect()

    def _collect(self) -> None:
        for rid in self.table.rids():
            e = self.table.entry(rid)
            while not e.queue.empty():
                d = e.queue.get_nowait()
                o = self.out.setdefault(rid, {"tokens": [], "finish": None, "error": None, "from": []})
                o["tokens"] += d.token_ids
                if d.token_ids:
                    o["from"].append(e.stream_from)
                if d.finish_reason:  # the first ending is what the client sees (the session closes)
                    o["finish"], o["error"], o["handed_back"] = d.finish_reason, d.error, d.handed_back
                    self.table.close(rid)
                    break

    @property
    def busy(self) -> bool:
        return bool(
            len(self.table)
            or self.inbox
            or any(s.jobs for w, s in self.workers.items() if w not in self.dead and w != "p0")
            or any(j.released for j in self.workers["p0"].jobs.values())  # computed into its cache, unasked
        )

    def run(self, max_steps: int = 5000) -> dict:
        for _ in range(max_steps):
            if not self.busy:
                break
            self.step()
        assert not self.busy, f"harness did not drain: {self.table.rids()}"
        return self.out

    def check_clean(self) -> None:
        for w, s in self.workers.items():
            if w in self.dead:
                continue
            s.check_integrity()
            assert s.kv.usage([]).used == 0, w
            if w != "p0" and s.retract.host is not None:
                assert s.retract.host.num_free() == s.retract.host.num_pages, w

    def close(self) -> None:
        self.workers["p0"].sender.close()
        for w in ("d1", "d2"):
            if self.workers[w].migration is not None:
                self.workers[w].migration.sender.close()
        for t in self.transports:
            t.close()
