"""The decode worker's metrics: scheduler counters plus transfer, retract and host-pool series."""

from __future__ import annotations

from decode_worker.migration import MIGRATION_BUCKETS
from engine.scheduler.base import Snapshot
from engine.scheduler.stats import Histogram


def decode_snapshot(s, base: Snapshot) -> Snapshot:
    """``base`` (the shared counters and pool gauges) extended with what only a decode worker has;
    ``s`` is the ``DecodeScheduler``."""
    rs = s.retract.stats
    base.counters.update(
        transfer_failures=s.transfer_failures,
        retract_offload_bytes=rs.offload_bytes,
        retract_resumed=rs.resumed,
        retract_recomputed=rs.recomputed,
        retract_offloaded=rs.offloaded,
        **s.local.counters(),
    )
    base.gauges.update(_queue_gauges(s))
    for state in ("ready", "connecting", "failed", "dead"):  # its prefill workers and migration sources
        base.gauges[f"kv_sources_{state}"] = sum(p.state == state for p in s.peers.by_addr.values())
    _add_migration(s, base)
    if s.spec is not None:  # speculative decoding (--speculative-method): the colocated worker's series
        counters, histograms = s.spec.series()
        base.counters.update(counters)
        base.histograms.update(histograms)
    base.histograms.update(
        retract_offload_seconds=s.retract.offload_seconds,
        retract_resume_seconds=s.retract.resume_seconds,
        **s.timeline.histograms,
    )
    return base


def _queue_gauges(s) -> dict:
    """Requests in each of the decode worker's queues, and the memory and prefill room it reports."""
    host = s.retract.host
    return dict(
        queue_prealloc=len(s.transfers.prealloc),
        queue_transfer=len(s.transfers.inflight),
        queue_running=len(s.running),
        queue_retracted=len(s.retract.queue),
        queue_local_prefill=len(s.local.waiting) + (s.local.chunked is not None),
        queue_migrating=len(s.migration.offered) if s.migration is not None else 0,
        new_token_ratio=s.running.ratio.value,
        # for cache-aware routing's local-prefill option (server/router/cache_routing.py)
        local_prefill_max_tokens=s.local.policy.max_tokens,
        local_prefill_backlog_tokens=s.local.backlog_tokens,
        # for the SLO planner (server/router/planner.py): > 0, this worker prefills behind a backlog
        local_prefill_backlog_ratio=s.local.policy.backlog_ratio,
        host_kv_pool_bytes_used=host.used_pages() * host.page_bytes if host else 0,
        host_kv_pool_bytes_free=host.num_free() * host.page_bytes if host else 0,
    )


def _add_migration(s, base: Snapshot) -> None:
    """Migration counters, the room a migrated request could get here and the migration times."""
    ms = s.migration_stats
    base.counters.update(
        migrations_out_done=ms.out_done,
        migrations_out_failed=ms.out_failed,
        migrations_out_declined=ms.out_declined,
        migrations_in_done=ms.in_done,
        migrations_in_failed=ms.in_failed,
        migrations_in_refused=ms.in_refused,
        migration_bytes=ms.out_bytes,
    )
    in_flight = [*s.running, *(j.req for j in s.transfers.inflight.values())]
    # what a migrated request could get here now (admission's view): the router's pre-check
    # (none while it parks requests, has some waiting or offers its own to a peer: it is under
    # pressure itself, and two workers would swap their parked requests)
    offering = s.migration is not None and bool(s.migration.offered)
    base.gauges["migration_room_pages"] = (
        0
        if s.retract.queue or s.transfers.prealloc or offering
        else max(0, s.budget.headroom(in_flight, s.running.ratio.value).full)
    )
    base.histograms["migration_seconds"] = (
        s.migration.seconds if s.migration is not None else Histogram(MIGRATION_BUCKETS)
    )
