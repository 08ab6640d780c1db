"""PD decode retract: keep a victim's KV in the host pool and resume it locally, or drop it and
have the prefill worker recompute it, whichever the cost model says is cheaper.

Offload copies ``pages_for(kv_len)`` device pages (every token but the newest, which is the next
step's input) into host pages, then frees the device pages. On CUDA the copy runs on a side
stream that is synchronized before the pages are released, so they are never reused early.
The job then waits in ``queue`` (the ``retracted_queue``); ``resume_ready`` brings jobs back, in
order, as soon as their pages plus the running batch's reserve fit: fresh device pages, KV
copied back, host pages freed, and the request rejoins the batch exactly where it was.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from cache.host_pool import HostKVPool
from cache.kv_manager import KVManager
from decode_worker.jobs import DecodeJob
from engine.request import Phase, Request
from engine.scheduler.decode_memory import decode_pages_needed
from engine.scheduler.stats import Histogram

RETRACT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class RetractCosts:
    """Rough throughputs for the offload-vs-recompute choice (measured on the 2-core CPU box)."""

    copy_bytes_per_s: float = 5e9        # host <-> device pool copies, each direction
    prefill_tokens_per_s: float = 600.0  # prefill worker compute
    transfer_bytes_per_s: float = 5e9    # prefill -> decode KV write


@dataclass
class RetractStats:
    offloaded: int = 0
    offload_bytes: int = 0
    resumed: int = 0
    recomputed: int = 0


class RetractManager:
    def __init__(self, kv: KVManager, device_buffer: torch.Tensor, host: HostKVPool | None,
                 gather: Callable | None = None, costs: RetractCosts | None = None) -> None:
        """``gather(buffer, pages)``: the page gather used to offload from a CUDA pool."""
        self.kv = kv
        self.device_buffer = device_buffer
        self.host = host
        self.gather = gather
        self.costs = costs or RetractCosts()
        self.stats = RetractStats()
        self.queue: deque[DecodeJob] = deque()
        self.offload_seconds = Histogram(RETRACT_BUCKETS)
        self.resume_seconds = Histogram(RETRACT_BUCKETS)
        self.stream = torch.cuda.Stream() if device_buffer.is_cuda else None

    def choose(self, req: Request) -> str:
        """"offload" when the host pool has room and copying out and back beats recomputing."""
        n_pages = self.kv.pages_for(req.kv_len)
        if self.host is None or not self.host.can_hold(n_pages):
            return "recompute"
        nbytes = n_pages * self.host.page_bytes
        c = self.costs
        t_copy = 2 * nbytes / c.copy_bytes_per_s
        t_recompute = req.kv_len / c.prefill_tokens_per_s + nbytes / c.transfer_bytes_per_s
        return "offload" if t_copy <= t_recompute else "recompute"

    def offload(self, job: DecodeJob) -> None:
        """Copy the KV to the host pool, release the device pages (not into the radix cache) and
        park the job in ``queue``."""
        req, t0 = job.req, time.perf_counter()
        n_pages = self.kv.pages_for(req.kv_len)
        job.host_kv = self.host.offload(self.device_buffer, req.kv.pages[:n_pages], req.kv_len, self.stream,
                                        self.gather)
        if self.stream is not None:
            self.stream.synchronize()  # device pages must not be reused before the copy lands
        self.kv.free(req.kv)
        req.retraction_count += 1
        req.status = Phase.RETRACTED
        self.queue.append(job)
        self.stats.offloaded += 1
        self.stats.offload_bytes += n_pages * self.host.page_bytes
        self.offload_seconds.observe(time.perf_counter() - t0)

    def resume_ready(self, running: list[Request], retract_steps: int) -> list[DecodeJob]:
        """Bring back, in queue order, every job whose pages fit after the running batch's own
        ``retract_steps``-step reserve; stop at the first that does not."""
        resumed: list[DecodeJob] = []
        while self.queue:
            job = self.queue[0]
            reserve = decode_pages_needed(self.kv, running + [j.req for j in resumed], retract_steps)
            # capped at the pool: a request parked with a shorter reserve still comes back, alone
            need = min(self.kv.pages_for(job.req.kv_len + retract_steps), self.kv.allocator.num_pages)
            if self.kv.available_pages() - reserve < need or not self._load(job):
                break
            resumed.append(self.queue.popleft())
        return resumed

    def _load(self, job: DecodeJob) -> bool:
        """Copy the KV back into fresh pages. False (nothing changed) if the pages are not there."""
        req, t0 = job.req, time.perf_counter()
        n_pages = len(job.host_kv.pages)
        if not self.kv.ensure_pages(req.kv, req.kv_len):
            return False
        self.host.load(self.device_buffer, job.host_kv, req.kv.pages[:n_pages])
        job.host_kv = None
        self.stats.resumed += 1
        self.resume_seconds.observe(time.perf_counter() - t0)
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
