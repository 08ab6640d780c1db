"""The router's part in moving a retracted request between decode workers (the workers' part is
``decode_worker.migration``): choose the peer, re-point the token stream, undo on failure.

- ``MigrationOffer`` from decode worker S: ``pick_target`` chooses the ready decode worker, other
  than S, of S's model and page size whose latest report has the most ``migration_room_pages`` (room
  after the running batch's reservation, nothing waiting, parked or offered there), less the pages
  of offers sent its way since that report, and at least the offer's ``pages``. The request's
  in-flight entry then streams from the target T (``workers`` gains T; its death does not fail the
  request until T sent a token) and T gets a ``MigrateRequest`` (a fresh room). No peer (or no
  entry): S gets ``MigrationDeclined`` and resumes locally.
- S stops producing tokens for the request when it offers it and T starts only once the KV
  landed, so the stream has no gap or duplicate: tokens come from S up to the offer and from T
  after it, into the same queue.
- ``MigrationEnded`` from S (ok): S leaves the entry. Not ok, from S (the write failed, the offer
  expired) or from T (it refused): the stream is S's again, T is aborted and leaves the entry;
  S is told ``MigrationDeclined`` when the refusal came from T.
- T lost (dead, restarted, drained: ``target_lost``) before S reported: undone as above (S is
  told), unless the request already streamed from T (then it failed with T). S may finish a write
  that was under way and forget the request all the same (a decline cannot stop a write): its
  ``MigrationEnded(ok=True)`` then fails the request with an explicit error instead of leaving
  the client waiting for tokens that neither worker will send.

A ``QueuedOffer`` (``--migrate-queued``: a request still waiting for pages on S, not prefilled):
the same pick; with a target, S gets ``QueuedMove`` (it drops the request and withdraws its
prefill) and the request's session a ``Moved`` marker (it sends the request to its prefill worker
and T under a new id); with none, ``MigrationDeclined``. Nothing has streamed yet, so the client
sees only a later first token.

``pdserve_migrations_total`` and friends come from the workers' counters (``server.router.metrics``);
queued moves are counted by the sessions (``pdserve_router_queued_moves_total``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from server.router.inflight import InflightTable
from server.router.worker_client import WorkerUnavailable
from server.router.workers import READY, WorkerHandle
from transfer.wire.enums import Role
from transfer.wire.protocol import MigrationEnded, MigrationOffer, QueuedOffer

log = logging.getLogger(__name__)


def pick_target(
    handles: Iterable[WorkerHandle],
    source: WorkerHandle,
    pages: int,
    granted: Callable[[WorkerHandle], int] = lambda h: 0,
) -> WorkerHandle | None:
    """The ready decode worker other than ``source``, of its model and page size, with the most
    reported ``migration_room_pages`` less ``granted(h)`` (pages of offers sent its way since that
    report) and at least ``pages`` of it; None if there is none."""
    best, best_room = None, -1.0
    src = source.stats
    for h in handles:
        if h is source or h.state != READY or h.spec.role != Role.DECODE or h.stats is None or src is None:
            continue
        if h.stats.model != src.model or h.stats.page_size != src.page_size:
            continue
        room = h.stats.gauges.get("migration_room_pages", 0.0) - granted(h)
        if room >= pages and room > best_room:
            best, best_room = h, room
    return best


class Migrations:
    """Offers and endings of migrations for one router (module docstring). Synchronous; runs on
    the event loop thread like the registry. ``next_room`` hands out transfer rooms."""

    def __init__(self, handles: Mapping[str, WorkerHandle], table: InflightTable, next_room) -> None:
        self.handles, self.table, self.next_room = handles, table, next_room
        self.moving: dict[str, tuple[str, str]] = {}  # rid -> (source, target) while a migration is under way
        self.abandoned: dict[str, tuple[str, str]] = {}  # undone because the target was lost; the source may not know
        # worker -> (the report it was granted against, pages granted since): a report is up to a
        # heartbeat old, and offers of one burst must not all count on the same room
        self.granted: dict[str, tuple[object, int]] = {}

    def granted_since_report(self, h: WorkerHandle) -> int:
        """Pages of offers sent to ``h`` since its latest report (0 once a new report came)."""
        report, pages = self.granted.get(h.worker_id, (None, 0))
        return pages if report is h.stats else 0

    def attach(self, h: WorkerHandle) -> None:
        """Route ``h``'s migration messages here (clients without the hook are left alone)."""
        if hasattr(h.client, "on_migration"):
            h.client.on_migration = self.on_message

    def on_message(self, worker_id: str, msg, ids: list[int]) -> None:
        """A ``MigrationOffer`` (with its ids) or ``MigrationEnded`` from decode worker ``worker_id``."""
        if isinstance(msg, MigrationOffer):
            self.on_offer(worker_id, msg, ids)
        elif isinstance(msg, QueuedOffer):
            self.on_queued_offer(worker_id, msg)
        else:
            self.on_ended(worker_id, msg)

    def on_offer(self, source_id: str, offer: MigrationOffer, ids: list[int]) -> None:
        """Send the request to a peer with room and stream from it, or decline to ``source_id``."""
        source = self.handles.get(source_id)
        entry = self.table.entry(offer.rid)
        target = None
        if source is not None and entry is not None and entry.stream_from == source_id:
            target = pick_target(self.handles.values(), source, offer.pages, self.granted_since_report)
        if target is None:
            why = "no peer decode worker has room" if entry is not None else "the router has no such request"
            self._decline(source_id, offer.rid, why)
            return
        self.table.repoint(offer.rid, target.worker_id)
        self.granted[target.worker_id] = (target.stats, self.granted_since_report(target) + offer.pages)
        self.moving[offer.rid] = (source_id, target.worker_id)
        log.info("migrating %s from %s to %s (%d tokens)", offer.rid, source_id, target.worker_id, offer.n_tokens)
        try:
            target.client.migrate(
                offer.rid,
                ids,
                offer.params,
                self.next_room(),
                source.spec.addr,
                offer.prompt_len,
                offer.n_tokens,
                draft=offer.draft,
            )
        except WorkerUnavailable as e:
            self._undo(offer.rid, f"could not reach {target.worker_id}: {e}", decline=True)

    def on_queued_offer(self, source_id: str, offer: QueuedOffer) -> None:
        """Move a request waiting for pages on ``source_id`` to a peer with room, or decline."""
        source = self.handles.get(source_id)
        entry = self.table.entry(offer.rid)
        if entry is None:
            return  # its session ended: the abort it sent ends the request on the worker
        target = None
        if source is not None and entry.stream_from == source_id and not entry.streamed:
            target = pick_target(self.handles.values(), source, offer.pages, self.granted_since_report)
        if target is None:
            self._decline(source_id, offer.rid, "no peer decode worker has room")
            return
        try:
            source.client.move_queued(offer.rid, target.worker_id)
        except WorkerUnavailable as e:
            log.warning("queued move of %s not delivered to %s: %s", offer.rid, source_id, e)
            return
        self.granted[target.worker_id] = (target.stats, self.granted_since_report(target) + offer.pages)
        log.info(
            "moving queued %s from %s to %s (waited %.2fs)", offer.rid, source_id, target.worker_id, offer.waited_s
        )
        self.table.move(offer.rid, target.worker_id)

    def target_lost(self, worker_id: str, why: str, failed: Iterable[str] = ()) -> None:
        """``worker_id`` is gone: forget the migrations of the requests in ``failed`` (they ended
        with it); undo every other migration headed to it, telling each source, and remember it
        (``on_ended``)."""
        failed = set(failed)
        self.abandoned = {rid: pair for rid, pair in self.abandoned.items() if rid in self.table}
        for rid, (source_id, target_id) in list(self.moving.items()):
            if rid in failed:  # it ended with the lost worker (its source or its target)
                del self.moving[rid]
                continue
            if target_id != worker_id:
                continue
            self._undo(rid, f"the target {worker_id} was lost: {why}", decline=True)
            self.abandoned[rid] = (source_id, target_id)

    def on_ended(self, worker_id: str, msg: MigrationEnded) -> None:
        """A source's report (ok or not), or a target's refusal."""
        pair = self.moving.get(msg.rid)
        if pair is None:
            self._abandoned_ended(worker_id, msg)
            return
        source_id, target_id = pair
        if msg.ok and worker_id == source_id:
            del self.moving[msg.rid]
            self.table.leave(msg.rid, source_id)
        elif not msg.ok:
            self._undo(msg.rid, msg.error or "migration failed", decline=worker_id == target_id)

    def _abandoned_ended(self, worker_id: str, msg: MigrationEnded) -> None:
        """The source of a migration undone by ``target_lost`` reports its write's end: failed, it
        resumes the request itself; done, it dropped the request: fail it explicitly."""
        pair = self.abandoned.get(msg.rid)
        if pair is None or worker_id != pair[0]:
            return
        del self.abandoned[msg.rid]
        if msg.ok:
            log.warning("migration of %s from %s to %s finished after the target was lost: failing it", msg.rid, *pair)
            self.table.fail(
                msg.rid,
                503,
                f"request {msg.rid} moved to decode worker {pair[1]}, which was lost "
                f"before it could stream; retry the request",
            )

    def _undo(self, rid: str, why: str, decline: bool) -> None:
        source_id, target_id = self.moving.pop(rid)
        log.warning("migration of %s from %s to %s undone: %s", rid, source_id, target_id, why)
        self.table.repoint(rid, source_id)
        self.table.leave(rid, target_id)
        if (t := self.handles.get(target_id)) is not None:
            t.client.abort([rid], f"migration undone: {why}")
        if decline:
            self._decline(source_id, rid, why)

    def _decline(self, source_id: str, rid: str, why: str) -> None:
        if (h := self.handles.get(source_id)) is not None:
            try:
                h.client.decline_migration(rid, why)
            except WorkerUnavailable as e:
                log.warning("decline of migration %s not delivered: %s", rid, e)
