"""PD decode retract: keep a victim's KV in the host pool and resume it locally, or drop it and
have the prefill worker recompute it, whichever the cost model says is cheaper.

Offload copies ``pages_for(kv_len)`` full pages (every token but the newest, which is the next
step's input) and, for a sliding-window hybrid, only the SWA pages of its window
(``SWAWindow.keep_start`` on), as unit rows of ``KVPools``, into host rows, then frees the
device pages. A radix prefix that another request locks too (the prompt of an ``n`` > 1 request,
shared on landing) is not copied: freeing it would free nothing, so it stays on the device, locked
by the parked handle (``cache.prefix_share.park``; ``HostKV.first_page`` says where the host rows start),
and only the request's own pages go to the host. On CUDA the copy runs on a side
stream that is synchronized before the pages are released, so they are never reused early.
The job then waits in ``queue`` (the ``retracted_queue``); ``resume_ready`` brings jobs back, in
order, as soon as their pages plus the running batch's reserve fit: fresh device pages after the
kept prefix, KV copied back, host pages freed, and the request rejoins the batch exactly where it
was. A migration needs the whole KV on the host: ``host_copy_whole`` copies the kept prefix out
first (and drops its lock).

``RetractManager`` is the decode side's one lifecycle past admission (``DecodeState``):
``retract`` (a victim of the running batch) -> ``offload`` (RUNNING -> HOST_PARKED) or
``recompute`` (RUNNING -> RECOMPUTING: generation + 1, back to the transfer tracker), and
``resume_ready`` (HOST_PARKED -> RUNNING). A host-parked job holds all its state (``host_kv``,
``generation``, the request): migrating it elsewhere is one more edge out of HOST_PARKED and one
more method here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from cache.host_pool import HostKVPool
from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from cache.kv_pools import KVPools
from cache.page_count import PageCount
from cache.prefix_share import park, shared_elsewhere
from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.transfers import TransferTracker
from engine.request import Release, Request
from engine.scheduler.stats import Histogram

RETRACT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class RetractCosts:
    """Rough throughputs for the offload-vs-recompute choice (a small CPU host's orders of magnitude:
    the choice only compares the two costs)."""

    copy_bytes_per_s: float = 5e9  # host <-> device pool copies, each direction
    prefill_tokens_per_s: float = 600.0  # prefill worker compute
    transfer_bytes_per_s: float = 5e9  # prefill -> decode KV write


@dataclass
class RetractStats:
    offloaded: int = 0
    offload_bytes: int = 0
    kept_shared_pages: int = 0  # radix-prefix pages parked requests left on the device (not copied)
    resumed: int = 0
    recomputed: int = 0


class RetractManager:
    """Offload, recompute and resume of the decode worker's retracted jobs (module docstring)."""

    def __init__(
        self,
        kv: KVManager,
        pools: KVPools,
        host: HostKVPool | None,
        transfers: TransferTracker,
        gather: Callable | None = None,
        costs: RetractCosts | None = None,
    ) -> None:
        """``transfers``: where a recompute queues; ``gather(buffer, rows)``: the row gather used to
        offload from a CUDA pool."""
        self.kv = kv
        self.budget = PageBudget(kv)
        self.transfers = transfers
        self.pools = pools
        self.device_buffer = device_buffer = pools.units
        self.host = host
        self.gather = gather
        self.costs = costs or RetractCosts()
        self.stats = RetractStats()
        self.queue: deque[DecodeJob] = deque()
        self.offload_seconds = Histogram(RETRACT_BUCKETS)
        self.resume_seconds = Histogram(RETRACT_BUCKETS)
        self.stream = torch.cuda.Stream() if device_buffer.is_cuda else None

    def _rows(self, req: Request, first: int = 0) -> tuple[np.ndarray, list[int]]:
        """The unit rows holding ``req``'s KV that a resume needs (full pages from logical page
        ``first`` on: the ones before stay on the device), and its SWA logical pages."""
        n_pages = self.budget.pages_for(req.kv_len)
        swa = req.kv.swa_pages
        if swa is None:
            return self.pools.unit_rows(req.kv.pages[first:n_pages]), []
        assert first == 0, "an SWA pool keeps no prefix on the device"
        keep = self.budget.window_first_page(req.kv_len)
        index = [j for j in range(keep, min(n_pages, len(swa))) if swa[j] >= 0]
        return self.pools.unit_rows(req.kv.pages[:n_pages], [swa[j] for j in index]), index

    def choose(self, req: Request) -> Release:
        """OFFLOAD when the host pool has room and copying out and back beats recomputing (the
        prefix another request holds too is neither copied nor recomputed)."""
        if not self.can_offload(req):
            return Release.RECOMPUTE
        rows, _ = self._rows(req, shared_elsewhere(self.kv, req.kv))
        nbytes = len(rows) * self.host.page_bytes
        c = self.costs
        t_copy = 2 * nbytes / c.copy_bytes_per_s
        t_recompute = req.kv_len / c.prefill_tokens_per_s + nbytes / c.transfer_bytes_per_s
        return Release.OFFLOAD if t_copy <= t_recompute else Release.RECOMPUTE

    def can_offload(self, req: Request) -> bool:
        """Whether the host pool has room for ``req``'s KV (its prefix held elsewhere apart)."""
        rows, _ = self._rows(req, shared_elsewhere(self.kv, req.kv))
        return self.host is not None and self.host.can_hold(len(rows))

    def retract(self, job: DecodeJob) -> Release:
        """Take a victim of the running batch out of it: ``offload`` or ``recompute``, whichever
        ``choose`` says; its device pages are free on return. Returns which one (for the log)."""
        how = self.choose(job.req)
        if how is Release.OFFLOAD:
            self.offload(job)
        else:
            self.recompute(job)
        return how

    def offload(self, job: DecodeJob) -> None:
        """RUNNING -> HOST_PARKED: copy the KV but its prefix held elsewhere to the host pool,
        release the device pages (not into the radix cache; the prefix stays locked, ``park``)
        and park the job in ``queue``."""
        req, t0 = job.req, time.perf_counter()
        first = shared_elsewhere(self.kv, req.kv)
        rows, swa_index = self._rows(req, first)
        job.host_kv = self.host.offload(self.device_buffer, rows.tolist(), req.kv_len, self.stream, self.gather)
        job.host_kv.swa_index, job.host_kv.first_page = swa_index, first
        if self.stream is not None:
            self.stream.synchronize()  # device pages must not be reused before the copy lands
        kept = park(self.kv, req.kv)
        assert kept == first, (kept, first)
        req.retraction_count += 1
        job.enter(DecodeState.HOST_PARKED)
        self.queue.append(job)
        self.stats.offloaded += 1
        self.stats.kept_shared_pages += kept
        self.stats.offload_bytes += len(rows) * self.host.page_bytes
        self.offload_seconds.observe(time.perf_counter() - t0)

    def recompute(self, job: DecodeJob) -> None:
        """RUNNING -> RECOMPUTING: free the KV and have the prefill worker compute it again, as
        prefill ``generation + 1`` of ``seq_len - 1`` tokens (all but the next input token). The job
        goes first in the transfer tracker's queue, which sends the ``PrefillRequest`` (with its
        ``KVDestination``) once its pages are reserved."""
        req = job.req
        self.kv.free(req.kv)
        req.reset_for_retract()
        job.enter(DecodeState.RECOMPUTING)
        job.generation += 1
        job.n_tokens = req.seq_len - 1
        self.stats.recomputed += 1
        self.transfers.queue_recompute(job)

    def resume_ready(self, running: list[Request], retract_steps: int, slots: int | None = None) -> list[DecodeJob]:
        """HOST_PARKED -> RUNNING: bring back, in queue order, every job whose pages fit after the
        running batch's own ``retract_steps``-step reserve, at most ``slots`` of them (places left
        in the batch; None = no bound); stop at the first that does not fit. The caller puts the
        returned jobs' requests into its running batch."""
        resumed: list[DecodeJob] = []
        while self.queue and (slots is None or len(resumed) < slots):
            job = self.queue[0]
            need = self.budget.resume_need(job.req.kv_len, retract_steps, len(job.host_kv.swa_index))
            need -= PageCount(job.host_kv.first_page)  # on the device already
            beside = running + [j.req for j in resumed]
            if not self.budget.fits_beside(beside, retract_steps, need) or not self._load(job):
                break
            resumed.append(self.queue.popleft())
        return resumed

    def _load(self, job: DecodeJob) -> bool:
        """Copy the KV back into fresh pages. False (nothing changed) if the pages are not there."""
        req, t0 = job.req, time.perf_counter()
        swa_index, first = job.host_kv.swa_index, job.host_kv.first_page
        if not self.kv.restore(req.kv, req.kv_len, swa_index):
            return False
        n_pages = self.budget.pages_for(req.kv_len)
        rows = self.pools.unit_rows(req.kv.pages[first:n_pages], [req.kv.swa_pages[j] for j in swa_index])
        self.host.load(self.device_buffer, job.host_kv, rows.tolist())
        job.host_kv = None
        job.enter(DecodeState.RUNNING)
        self.stats.resumed += 1
        self.resume_seconds.observe(time.perf_counter() - t0)
        return True

    def host_copy_whole(self, job: DecodeJob) -> bool:
        """Make a HOST_PARKED job's host copy hold its whole KV (a migration writes from it): copy
        the prefix it kept on the device (``HostKV.first_page`` pages) in front of its host rows
        and release that prefix's lock. True when the copy is whole; False, with nothing changed,
        when the host pool has no room for the prefix."""
        kv, req = job.host_kv, job.req
        if kv.first_page == 0:
            return True
        rows = self.pools.unit_rows(req.kv.pages[: kv.first_page]).tolist()
        if not self.host.can_hold(len(rows)):
            return False
        head = self.host.offload(self.device_buffer, rows, req.kv_len, self.stream, self.gather)
        if self.stream is not None:
            self.stream.synchronize()  # the prefix may be evicted and reused once unlocked
        kv.pages, kv.first_page = head.pages + kv.pages, 0
        self.kv.free(req.kv)
        return True

    def discard(self, job: DecodeJob) -> None:
        """Abort path: leave the queue and give the host pages back."""
        if job in self.queue:
            self.queue.remove(job)
        if job.host_kv is not None:
            self.host.free(job.host_kv)
            job.host_kv = None

    def check_integrity(self, jobs: Iterable[DecodeJob]) -> None:
        """Host pool: free + held by ``jobs`` (every live job) == total."""
        if self.host is not None:
            self.host.check_integrity([j.host_kv for j in jobs if j.host_kv is not None])
