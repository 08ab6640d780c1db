"""The decode worker's metrics: scheduler counters plus transfer, retract and host-pool series."""
from __future__ import annotations

from engine.scheduler.base import Snapshot


def decode_snapshot(s, base: Snapshot) -> Snapshot:
    """``base`` (the shared counters and pool gauges) extended with what only a decode worker has;
    ``s`` is the ``DecodeScheduler``."""
    rs, host = s.retract.stats, s.retract.host
    base.counters.update(transfer_failures=s.transfer_failures, retract_offload_bytes=rs.offload_bytes,
                         retract_resumed=rs.resumed, retract_recomputed=rs.recomputed,
                         retract_offloaded=rs.offloaded)
    base.gauges.update(queue_prealloc=len(s.transfers.prealloc), queue_transfer=len(s.transfers.inflight),
                       queue_running=len(s.running), queue_retracted=len(s.retract.queue),
                       new_token_ratio=s.running.ratio.value,
                       host_kv_pool_bytes_used=host.used_pages() * host.page_bytes if host else 0,
                       host_kv_pool_bytes_free=host.num_free() * host.page_bytes if host else 0)
    base.histograms.update(retract_offload_seconds=s.retract.offload_seconds,
                           retract_resume_seconds=s.retract.resume_seconds, **s.timeline.histograms)
    return base
