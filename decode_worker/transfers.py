"""Decode requests between arrival and the running batch: the prealloc queue (waiting for pages)
and the transfers in flight (pages reserved, KV being written by a prefill worker).

Admission (``admit``): prompt pages minus the decode radix prefix, plus ``max_new_tokens *
new_token_ratio`` reserved, FCFS (the first request that does not fit stops admission); an
admitted request gets its pages (QUEUED or RECOMPUTING -> AWAITING_KV) and a ``KVDestination``
goes to its prefill worker (with a ``PrefillRequest`` first for a recompute, ``prefill_request``).
The transport is polled for notifications only while a write is under way (``polling``: the
prefill worker announced it with ``KVWriteStarted``). A transfer leaves the tracker when its
completion notification lands (``landed``, manifest checked), when the prefill side reports
``PrefillFailed`` (``failed``), or, for a fenced job whose client was already answered, when its
prefill worker restarted or ``transfer_fence_s`` passed (``release_fences``): only then may its
pages be reused.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Container, Iterable
from dataclasses import dataclass

import numpy as np

from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from cache.page_count import PageCount
from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.manifest import manifest_error, parse_manifest
from decode_worker.peers import PrefillPeers
from engine.scheduler.admission import admit_prompt
from transfer.kv_transport import WARMUP_NOTIF, KVTransport
from transfer.wire.outbox import Outbox, Peer
from transfer.wire.protocol import (
    KVDestination,
    KVWriteStarted,
    PrefillFailed,
    PrefillRequest,
    TransferManifest,
    ids_frame,
)

log = logging.getLogger(__name__)


@dataclass
class Landing:
    """A transfer that ended: its manifest, or ``error`` when the manifest is not what was asked."""

    job: DecodeJob
    manifest: TransferManifest
    error: str | None = None


def prefill_request(job: DecodeJob, decode_worker: str) -> tuple[PrefillRequest, bytes]:
    """The ``PrefillRequest`` of a recompute and its token-ids frame: prefill ``job.generation``
    of the first ``job.n_tokens`` tokens of the request (prompt and output so far)."""
    req = job.req
    msg = PrefillRequest(
        rid=req.rid,
        room=job.room,
        generation=job.generation,
        params=req.params,
        decode_worker=decode_worker,
        continuation=req.continuation,
    )
    return msg, ids_frame(req.all_ids[: job.n_tokens])


class TransferTracker:
    """The prealloc queue and the transfers in flight of a decode worker (module docstring)."""

    def __init__(self, kv: KVManager, transport: KVTransport, worker_id: str) -> None:
        self.kv = kv
        self.budget = PageBudget(kv)
        self.transport = transport
        self.worker_id = worker_id
        self.prealloc: deque[DecodeJob] = deque()
        self.inflight: dict[tuple[int, int], DecodeJob] = {}

    def queue(self, job: DecodeJob) -> None:
        """A new (QUEUED) job waits for its pages: last in line, or with ``job.preempt`` after the
        other preempting jobs but before every job without the mark (recomputes included)."""
        if not job.preempt:
            self.prealloc.append(job)
            return
        at = next((i for i, j in enumerate(self.prealloc) if not j.preempt), len(self.prealloc))
        self.prealloc.insert(at, job)

    def queue_recompute(self, job: DecodeJob) -> None:
        """A RECOMPUTING job (``RetractManager.recompute``) waits for its pages, first in line but
        behind the jobs with ``preempt`` (it may be one they displaced); admission then sends its
        ``PrefillRequest`` before the ``KVDestination``."""
        assert job.state is DecodeState.RECOMPUTING, job.state
        at = next((i for i, j in enumerate(self.prealloc) if not j.preempt), len(self.prealloc))
        self.prealloc.insert(at, job)

    def writing(self, job: DecodeJob) -> bool:
        """True while a remote write into ``job``'s pages may still land."""
        return self.inflight.get(job.key) is job

    def discard(self, job: DecodeJob) -> None:
        if job in self.prealloc:
            self.prealloc.remove(job)

    def __len__(self) -> int:
        return len(self.prealloc) + len(self.inflight)

    def backlog_tokens(self) -> int:
        """Prompt tokens prefill workers still have to compute for this worker: the prealloc
        queue's whole prompts (their prefix match is not known yet) and, of the reserved transfers
        whose write has not started, what the decode prefix does not hold."""
        queued = sum(j.n_tokens for j in self.prealloc)
        return queued + sum(j.n_tokens - j.req.kv_len for j in self.inflight.values() if not j.write_posted)

    # ---- admission ----------------------------------------------------------------------------
    def admit(
        self,
        peers: PrefillPeers,
        free: PageCount,
        ratio: float,
        slots: int,
        only_preempting: bool = False,
        held: Container[str] = (),
    ) -> tuple[Outbox, list[DecodeJob]]:
        """Reserve pages for prealloc jobs within ``free`` pages and ``slots`` requests (with
        ``only_preempting``: only jobs with ``preempt``, which stand first in line), skipping the
        ``held`` request ids (offered to a peer: ``decode_worker.queued_moves``).
        Returns (messages to prefill workers, jobs whose prefill worker is unusable)."""
        out, unusable = Outbox(), []
        for job in list(self.prealloc):
            if slots <= 0 or (only_preempting and not job.preempt):
                break
            if job.req.rid in held:
                continue
            peer = peers.get(job.prefill_addr)
            if peer is not None and peer.unusable:
                unusable.append(job)
                continue
            if peer is None or not peer.ready:
                continue
            used = self._reserve(job, free, ratio)
            if used is None:
                break  # NO_TOKEN: FCFS, later requests must not overtake this one
            free, slots = free - used, slots - 1
            self.prealloc.remove(job)
            self._request_kv(job, out)
        return out, unusable

    def _reserve(self, job: DecodeJob, free: PageCount, ratio: float) -> PageCount | None:
        """Match the decode radix prefix and take the prompt's pages (for a sliding-window hybrid
        only the SWA tail, from ``SWAWindow.prealloc_start``); None if over budget."""
        req = job.req
        extra = self.budget.prompt_reservation(req, ratio, job.n_tokens)
        need = admit_prompt(self.kv, req, job.n_tokens, extra, free, self.budget.prealloc_start(job.n_tokens))
        if need is not None:
            job.decode_prefix_len = req.kv_len
        return need

    def _request_kv(self, job: DecodeJob, out: Outbox) -> None:
        req, to = job.req, Peer(job.prefill_addr)
        job.enter(DecodeState.AWAITING_KV)
        req.mark("reserved")
        self.inflight[job.key] = job
        if job.generation > 0 and not job.migrated:  # a migrated job's KV is already computed (at its source)
            out.send(to, *prefill_request(job, self.worker_id))
        log.debug("destination for %s room %d: %d pages", req.rid, job.room, len(req.kv.pages))
        dest = KVDestination(
            rid=req.rid,
            room=job.room,
            generation=job.generation,
            decode_prefix_len=job.decode_prefix_len,
            n_tokens=job.n_tokens,
        )
        swa = req.kv.swa_pages
        out.send(
            to,
            dest,
            np.asarray(req.kv.pages, dtype="<i4").tobytes(),
            np.asarray(swa if swa is not None else [], dtype="<i4").tobytes(),
        )

    # ---- transfers ending -----------------------------------------------------------------------
    def landed(self) -> list[Landing]:
        """Transfers whose completion notification arrived since the last call."""
        ended = []
        for _peer, raw in self.transport.poll_notifs():
            if raw == WARMUP_NOTIF:  # a source set its connection up (``KVSender._warm``)
                continue
            m = parse_manifest(raw)
            job = self.inflight.pop((m.room, m.generation), None) if m else None
            if job is None:
                log.warning("notification for no pending transfer: %r", raw[:200])
                continue
            log.debug("KV of %s room %d generation %d arrived", job.req.rid, job.room, job.generation)
            ended.append(Landing(job, m, manifest_error(m, job, self.kv.page_size)))
        return ended

    def failed(self, msg: PrefillFailed) -> DecodeJob | None:
        """The job ``msg`` is about (no longer in flight), or None if there is none."""
        key = (msg.room, msg.generation)
        job = self.inflight.pop(key, None)
        if job is None:
            job = next((j for j in self.prealloc if j.key == key), None)
        return job

    def posted(self, msg: KVWriteStarted) -> None:
        """The prefill worker started writing ``msg``'s room: its landing is polled for from now on
        (a room no longer in flight, e.g. aborted and released, is ignored)."""
        job = self.inflight.get((msg.room, msg.generation))
        if job is not None:
            job.write_posted = True
            job.req.mark("write_posted")

    @property
    def polling(self) -> bool:
        """True while a landing may come that only polling the transport reveals: a write the
        prefill worker announced (``KVWriteStarted``), or one whose writer announces nothing (a
        migration source). Rooms whose prefill is still computing need no polling: the
        announcement wakes the worker loop like any message."""
        return any(j.write_posted or j.migrated for j in self.inflight.values())

    def waiting_on(self, addr: str) -> list[DecodeJob]:
        """Jobs that depend on the prefill worker at ``addr`` (queued or in flight)."""
        return [j for j in (*self.prealloc, *self.inflight.values()) if j.prefill_addr == addr]

    def release_fences(self, restarted: Iterable[str], fence_s: float) -> list[DecodeJob]:
        """Fenced jobs whose pages can no longer be written: their prefill worker restarted, or
        ``fence_s`` passed. They leave the tracker; the caller frees them."""
        restarted, now = set(restarted), time.monotonic()
        done = [
            j
            for j in self.inflight.values()
            if j.answered and (j.prefill_addr in restarted or now - j.fenced_at > fence_s)
        ]
        for job in done:
            why = "prefill worker restarted" if job.prefill_addr in restarted else f"no answer within {fence_s:g}s"
            log.warning("freeing the pages of %s room %d: %s", job.req.rid, job.room, why)
            del self.inflight[job.key]
        return done
