"""PD decode retract: keep a victim's KV in the host pool and resume it locally, or drop it and
have the prefill worker recompute it, whichever the cost model says is cheaper.

Offload copies ``pages_for(kv_len)`` device pages (every token but the newest, which is the next
step's input) into host pages, then frees the device pages. On CUDA the copy runs on a side
stream that is synchronized before the pages are released, so they are never reused early.
Resume allocates fresh device pages, copies the KV back, frees the host pages; the request rejoins
the running batch exactly where it was.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cache.host_pool import HostKVPool
from cache.kv_manager import KVManager
from decode_worker.jobs import DecodeJob
from engine.scheduler.stats import Histogram

log = logging.getLogger(__name__)

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
    resume_bytes: int = 0
    recomputed: int = 0


class RetractManager:
    def __init__(self, kv: KVManager, device_buffer: torch.Tensor, host: HostKVPool | None,
                 costs: RetractCosts | None = None) -> None:
        self.kv = kv
        self.device_buffer = device_buffer
        self.host = host
        self.costs = costs or RetractCosts()
        self.stats = RetractStats()
        self.offload_seconds = Histogram(RETRACT_BUCKETS)
        self.resume_seconds = Histogram(RETRACT_BUCKETS)
        self.stream = torch.cuda.Stream() if device_buffer.is_cuda else None

    def choose(self, job: DecodeJob) -> str:
        """"offload" when the host pool has room and copying out and back beats recomputing."""
        n_pages = self.kv.pages_for(job.req.kv_len)
        if self.host is None or not self.host.can_hold(n_pages):
            return "recompute"
        nbytes = n_pages * self.host.page_bytes
        c = self.costs
        t_copy = 2 * nbytes / c.copy_bytes_per_s
        t_recompute = job.req.kv_len / c.prefill_tokens_per_s + nbytes / c.transfer_bytes_per_s
        return "offload" if t_copy <= t_recompute else "recompute"

    def offload(self, job: DecodeJob) -> None:
        """Copy the KV to the host pool and release the device pages (not into the radix cache)."""
        req, t0 = job.req, time.perf_counter()
        n_pages = self.kv.pages_for(req.kv_len)
        job.host_kv = self.host.offload(self.device_buffer, req.pages[:n_pages], req.kv_len, self.stream)
        if self.stream is not None:
            self.stream.synchronize()  # device pages must not be reused before the copy lands
        self.kv.release(req, insert=False)
        req.num_shared_pages, req.cached_tokens = 0, 0
        self.stats.offloaded += 1
        self.stats.offload_bytes += n_pages * self.host.page_bytes
        self.offload_seconds.observe(time.perf_counter() - t0)

    def can_resume(self, job: DecodeJob, reserve_pages: int, retract_steps: int) -> bool:
        need = self.kv.pages_for(job.req.kv_len + retract_steps)
        return self.kv.available_pages() - reserve_pages >= need

    def resume(self, job: DecodeJob) -> bool:
        """Copy the KV back into fresh pages. False (nothing changed) if the pages are not there."""
        req, t0 = job.req, time.perf_counter()
        n_pages = len(job.host_kv.pages)
        if not self.kv.ensure_pages(req, req.kv_len):
            return False
        self.host.load(self.device_buffer, job.host_kv, req.pages[:n_pages])
        job.host_kv = None
        self.stats.resumed += 1
        self.stats.resume_bytes += n_pages * self.host.page_bytes
        self.resume_seconds.observe(time.perf_counter() - t0)
        return True

    def drop_host(self, job: DecodeJob) -> None:
        """Abort path: give the host pages back."""
        if job.host_kv is not None:
            self.host.free(job.host_kv)
            job.host_kv = None
