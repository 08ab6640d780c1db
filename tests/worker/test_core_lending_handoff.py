"""Core lending after a KV handoff (server.worker.core_lending): a prefill worker that just handed
KV over borrows the decode worker's core only if that worker has no request to run once its KV is
in, and the decode worker publishes that flag (``has_queued_model_work``) beside its busy one."""

from __future__ import annotations

import mmap
import os

import pytest

from server.worker.core_lending import SLOT, CoreLedger, CoreLending


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _after_a_handoff(decode_busy: bool, decode_queued: bool) -> tuple[CoreLending, Clock]:
    """A prefill worker (slot 0) that just handed off KV to the decode worker (slot 1) publishing
    ``(decode_busy, decode_queued)``."""
    ledger, fd = CoreLedger.create(2)
    os.close(fd)
    clock = Clock()
    cores = CoreLending(ledger, 0, 1, 2, set_threads=lambda n: None, clock=clock)
    CoreLending(ledger, 1, 1, 1, set_threads=lambda n: None).publish(decode_busy, decode_queued)
    cores.handed_off()
    clock.t += cores.handoff_grace_s / 2
    return cores, clock


def test_after_a_handoff_a_decode_worker_with_nothing_to_run_lends_at_once():
    """Back-to-back one-token requests: the KV's only token came with it, so the decode worker will
    not run the model; the next prompt's prefill borrows its core inside the grace."""
    cores, _ = _after_a_handoff(decode_busy=False, decode_queued=False)
    assert cores.begin_step() == 2 and cores.borrowed_steps == 1


def test_after_a_handoff_a_decode_worker_with_a_request_to_run_keeps_its_core():
    """The decode worker that was just handed KV may not have flagged itself busy yet: while it has
    a request to run (queued) the borrower keeps its own share for the grace, and after it whatever
    the queued flag says (the queued request may wait for the very prompt this worker computes)."""
    cores, clock = _after_a_handoff(decode_busy=False, decode_queued=True)
    assert cores.begin_step() == 1
    clock.t += cores.handoff_grace_s
    assert cores.begin_step() == 2 and cores.borrowed_steps == 1
    busy, clock = _after_a_handoff(decode_busy=True, decode_queued=False)
    assert busy.begin_step() == 1
    clock.t += busy.handoff_grace_s
    assert busy.begin_step() == 1 and busy.borrowed_steps == 0


class _RecordingLedger(CoreLedger):
    """Records slot 0's ``(busy, queued)`` after every write."""

    def __init__(self, buf) -> None:
        super().__init__(buf)
        self.seen: list[tuple[int, int]] = []

    def _record(self) -> None:
        self.seen.append((int(self.slots["busy"][0]), int(self.slots["queued"][0])))

    def set_busy(self, slot: int, busy: bool) -> None:
        super().set_busy(slot, busy)
        self._record()

    def set_queued(self, slot: int, queued: bool) -> None:
        super().set_queued(slot, queued)
        self._record()


def test_a_request_moving_from_queued_to_busy_never_reads_as_neither():
    fd = os.memfd_create("ledger")
    try:
        os.ftruncate(fd, SLOT.itemsize)
        ledger = _RecordingLedger(mmap.mmap(fd, SLOT.itemsize))
    finally:
        os.close(fd)
    cores = CoreLending(ledger, 0, 1, 1, set_threads=lambda n: None)
    cores.publish(False, True)  # pages reserved, KV awaited
    cores.publish(True, False)  # landed: in the batch
    cores.publish(False, True)  # finished; another one queued
    assert (0, 0) not in ledger.seen, ledger.seen
    assert ledger.seen[-1] == (0, 1)


@pytest.mark.parametrize("max_new_tokens,queued", [(1, False), (3, True)])
def test_a_decode_worker_has_a_request_to_run_only_if_it_decodes_after_its_kv(tiny, max_new_tokens, queued):
    """In process: a decode worker awaiting a request's KV publishes it as queued model work only if
    the request needs decode steps after its first token (the prefill worker's); once the KV landed
    such a request is in the batch (busy) and no longer queued."""
    from bench.harness.pd_harness import PDHarness
    from configs.schema import PdserveConfig
    from transfer.wire.sampling_params import SamplingParams

    cfg = PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )
    h = PDHarness(cfg, cfg, tiny[0], tiny[1])
    try:
        seen = []
        h.submit("r0", list(range(1, 11)), SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
        while h.busy:
            seen.append((h.decode.has_queued_model_work, h.decode.has_model_work, h.decode.awaits_peer_compute))
            h.step()
        assert (queued, False, True) in seen and (not queued, False, True) not in seen, seen
        assert ((False, True, False) in seen) == queued, seen  # decoding after the KV landed
        assert not h.decode.has_queued_model_work
        h.check_clean()
    finally:
        h.close()
