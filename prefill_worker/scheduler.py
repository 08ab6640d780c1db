"""Prefill worker scheduler: compute prompts, sample the first token, ship the KV to a decode worker.

Per request (a ``PrefillJob``, keyed by ``(room, generation)``):
  queued -> prefilled (first token known) -> transferring -> released.
The decode worker's ``KVDestination`` may arrive before or after the prefill completes; the
transfer starts once both are there. The KV stays locked in this worker's pool until the transfer
finished or failed, then goes to the radix cache (``release(insert=True)``) for later prefix hits.
Any failure is reported both to the sender of the ``PrefillRequest`` (a ``TokenEvent`` abort) and
to the decode worker (``PrefillFailed``: nothing was or will be written to its pages).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from cache.kv_manager import KVManager
from configs.schema import PdserveConfig
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling import SamplerState
from engine.scheduler.admission import Admission
from engine.scheduler.base import RequestRejected, WorkerScheduler
from engine.scheduler.events import TokenEvent
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.stats import TRANSFER_BUCKETS, Histogram, SchedulerStats
from prefill_worker.kv_sender import KVSender
from transfer.protocol import (KVDestination, KVHandshake, KVHandshakeAck, PrefillFailed, PrefillRequest,
                               TransferManifest, frame_ids)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillJob:
    req: Request
    room: int
    generation: int
    decode_worker: str
    owner: bytes
    created: float
    dest: KVDestination | None = None
    dest_ident: bytes | None = None  # the decode worker's connection that asked for the KV
    dest_pages: np.ndarray | None = None
    manifest: TransferManifest | None = None
    transferring: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return self.room, self.generation


class PrefillScheduler(WorkerScheduler):
    """Driven by ``WorkerLoop``: ``handle`` for PD messages, ``step`` every loop iteration."""

    role = "prefill"

    def __init__(self, runner: ModelRunner, cfg: PdserveConfig, sender: KVSender, send, model_name: str,
                 worker_id: str) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.cfg = cfg
        self.kv = KVManager(runner.allocator, runner.page_size, cfg.scheduler.enable_radix_cache)
        self.admission = Admission(cfg.scheduler, self.kv, reserve_decode=False)
        self.executor = BatchExecutor(runner, ())
        self.sender = sender
        self.send = send  # send(ident, msg, *frames)
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.waiting: deque[Request] = deque()
        self.jobs: dict[tuple[int, int], PrefillJob] = {}
        self.by_req: dict[int, PrefillJob] = {}
        self.transfer_bytes = 0
        self.transfer_failures = 0
        self.transfer_seconds = Histogram(TRANSFER_BUCKETS)

    # ---- messages ---------------------------------------------------------------------------
    def handle(self, ident: bytes, msg, frames: list[bytes]) -> bool:
        if isinstance(msg, PrefillRequest):
            self._on_prefill(ident, msg, frame_ids(frames[0]))
        elif isinstance(msg, KVDestination):
            self._on_destination(ident, msg, np.frombuffer(frames[0], dtype="<i4").copy())
        elif isinstance(msg, KVHandshake):
            self._on_handshake(ident, msg)
        else:
            return False
        return True

    def _on_handshake(self, ident: bytes, msg: KVHandshake) -> None:
        error = self.sender.accept_peer(ident, msg, self.model_name, self.runner.pool.layout_descriptor())
        self.send(ident, KVHandshakeAck(ok=error is None, worker_id=self.worker_id, error=error))

    def _on_prefill(self, ident: bytes, msg: PrefillRequest, ids: list[int]) -> None:
        key = (msg.room, msg.generation)
        if key in self.jobs:
            return self._fail_owner(ident, msg.rid, f"duplicate room {msg.room} generation {msg.generation}", 400)
        try:
            self._check_fits(len(ids))
        except RequestRejected as e:
            self.stats.rejected_requests += 1
            self._fail_owner(ident, msg.rid, str(e), 400)
            self.sender.notify_failed(msg.decode_worker, PrefillFailed(rid=msg.rid, room=msg.room,
                                      generation=msg.generation, error=str(e), error_status=400))
            return
        vocab = self.runner.model_config.vocab_size
        req = Request(msg.rid, ids, msg.params, SamplerState.new(msg.params, vocab, ids))
        job = PrefillJob(req, msg.room, msg.generation, msg.decode_worker, ident, time.monotonic())
        self.jobs[key], self.by_req[id(req)] = job, job
        self.waiting.append(req)
        self.stats.prompt_tokens += len(ids)

    def _check_fits(self, n: int) -> None:
        if n == 0:
            raise RequestRejected("prompt is empty; send at least one token")
        if n > self.runner.capacity_tokens:
            raise RequestRejected(f"prompt ({n} tokens) exceeds the prefill worker's KV pool of "
                                  f"{self.runner.capacity_tokens} tokens; start it with a larger --kv-pool-tokens")

    def _on_destination(self, ident: bytes, msg: KVDestination, pages: np.ndarray) -> None:
        job = self.jobs.get((msg.room, msg.generation))
        if job is None:  # unknown, finished or failed: tell the decode side nothing will come
            self.send(ident, PrefillFailed(rid=msg.rid, room=msg.room, generation=msg.generation,
                                           error="prefill worker has no such request (aborted or failed)"))
            return
        if msg.n_tokens != len(job.req.prompt_ids) or msg.decode_prefix_len % self.runner.page_size:
            self._fail(job, f"destination mismatch: decode expects {msg.n_tokens} tokens from "
                            f"{msg.decode_prefix_len}, prefill has {len(job.req.prompt_ids)}", 500)
            return
        job.dest, job.dest_pages, job.dest_ident = msg, pages, ident
        log.debug("destination for %s room %d: %d pages from token %d", msg.rid, msg.room, len(pages),
                  msg.decode_prefix_len)

    def abort(self, rid: str, message: str = "request aborted") -> TokenEvent | None:
        for job in [j for j in self.jobs.values() if j.req.rid == rid]:
            if job.transferring:
                job.req.error = message  # the write is in flight: finish it, then drop the KV
            else:
                self._fail(job, message, 499, tell_owner=False)
        return None

    # ---- loop ---------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.admission.chunked or self.sender.busy)

    def step(self) -> list[TokenEvent]:
        self._finish_transfers()
        items = self.admission.select(self.waiting, [], 0.0)
        if items:
            self.stats.extend_steps += 1
            self.stats.prefill_computed_tokens += sum(i.length for i in items)
            for req, ev in self.executor.extend(items):
                self.by_req[id(req)].manifest = self._manifest(self.by_req[id(req)], ev)
        self._start_transfers()
        self._expire()
        return []

    def _manifest(self, job: PrefillJob, ev: TokenEvent) -> TransferManifest:
        req = job.req
        tok = req.output_ids[-1]
        lp = req.params.logprobs is not None
        return TransferManifest(rid=req.rid, room=job.room, generation=job.generation, n_tokens=req.kv_len,
                                n_pages=0, first_token=tok, first_logprob=ev.logprobs[0] if lp and ev.logprobs else None,
                                first_top_logprobs=ev.top_logprobs[0] if lp and ev.top_logprobs else None)

    def _start_transfers(self) -> None:
        for job in list(self.jobs.values()):
            if job.transferring or job.manifest is None or job.dest is None:
                continue
            P = self.runner.page_size
            first, last = job.dest.decode_prefix_len // P, self.kv.pages_for(job.req.kv_len)
            src = np.asarray(job.req.pages[first:last], dtype=np.int32)
            dst = job.dest_pages[first:last]
            manifest = job.manifest.model_copy(update={"n_pages": len(src)}).sealed()
            job.transferring = True
            log.debug("transfer %s room %d: %d pages", job.req.rid, job.room, len(src))
            try:
                self.sender.start(job, job.decode_worker, src, dst, manifest)
            except Exception as e:  # noqa: BLE001 - any transport error fails this request only
                job.transferring = False
                self._fail(job, f"KV transfer could not start: {e}", 503)

    def _finish_transfers(self) -> None:
        for job, ok, error, nbytes, secs in self.sender.poll():
            job.transferring = False
            log.debug("transfer %s room %d ended ok=%s in %.4fs", job.req.rid, job.room, ok, secs)
            if ok:
                self.transfer_bytes += nbytes
                self.transfer_seconds.observe(secs)
                self._release(job, insert=True)
            else:
                self.transfer_failures += 1
                self._fail(job, f"KV transfer to decode worker failed: {error}", 503)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.cfg.cluster.bootstrap_timeout_s
        for job in [j for j in self.jobs.values() if j.dest is None and j.created < deadline]:
            self._fail(job, f"decode worker did not ask for the KV within {self.cfg.cluster.bootstrap_timeout_s}s", 504)

    # ---- endings --------------------------------------------------------------------------
    def _fail(self, job: PrefillJob, error: str, status: int, tell_owner: bool = True) -> None:
        log.warning("prefill %s room %d failed: %s", job.req.rid, job.room, error)
        if tell_owner:
            self._fail_owner(job.owner, job.req.rid, error, status)
        failed = PrefillFailed(rid=job.req.rid, room=job.room, generation=job.generation, error=error,
                               error_status=status)
        if job.dest_ident is not None:  # straight back on the connection that asked
            self.send(job.dest_ident, failed)
        else:
            self.sender.notify_failed(job.decode_worker, failed)
        self._release(job, insert=False)

    def _fail_owner(self, ident: bytes, rid: str, error: str, status: int) -> None:
        from transfer.protocol import TokenBatch, TokenEntry, encode, ids_frame

        self.send(ident, TokenBatch(entries=[TokenEntry(rid=rid, n=0, finish_reason="abort", error=error,
                                                        error_status=status)]), ids_frame([]))

    def _release(self, job: PrefillJob, insert: bool) -> None:
        req = job.req
        if req in self.waiting:
            self.waiting.remove(req)
        self.admission.drop(req)
        self.kv.release(req, insert=insert and job.manifest is not None)
        self.jobs.pop(job.key, None)
        self.by_req.pop(id(req), None)
        self.stats.finished_requests += 1

    # ---- introspection --------------------------------------------------------------------
    def live_requests(self) -> list[Request]:
        return [j.req for j in self.jobs.values()]

    def histograms(self) -> dict[str, "Histogram"]:
        return {"kv_transfer_seconds": self.transfer_seconds}

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        counters = {**self.base_counters(), "kv_transfer_bytes": float(self.transfer_bytes),
                    "transfer_failures": float(self.transfer_failures)}
        gauges = {**self.pool_gauges(), "queue_waiting": len(self.waiting),
                  "queue_bootstrap": sum(1 for j in self.jobs.values() if j.dest is None),
                  "queue_transfer": sum(1 for j in self.jobs.values() if j.transferring)}
        return counters, gauges
