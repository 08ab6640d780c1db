"""Unit tests of ``LocalPrefillQueue.take_continuation``: which continuations a decode worker
prefills itself (prompt + output so far) instead of leaving them to a prefill worker."""

from __future__ import annotations

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from configs.scheduler import SchedulerConfig
from decode_worker.local_prefill import LocalPrefillPolicy
from decode_worker.local_queue import LocalPrefillQueue
from engine.request import Request
from engine.sampling import SamplerState
from engine.scheduler.stats import SchedulerStats
from transfer.wire.sampling_params import SamplingParams


def queue(pages: int = 100, backlog_ratio: float = 1.0) -> LocalPrefillQueue:
    cfg = SchedulerConfig().for_device("cpu")
    kv = KVManager(PageAllocator(pages), 4, False)
    return LocalPrefillQueue(LocalPrefillPolicy(0, backlog_ratio=backlog_ratio), cfg, kv, SchedulerStats())


def cont(rid: str, prompt: int = 10, sent: int = 6, max_new: int = 16) -> Request:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0)
    return Request(rid, [1] * prompt, sp, SamplerState.new(sp, 10), output_ids=[2] * sent)


def take(q: LocalPrefillQueue, r: Request, remote: int, retracted: int = 0) -> bool:
    return q.take_continuation(r, lambda: (), 0.5, retracted, remote)


def test_taken_while_the_local_backlog_stays_within_the_remote_one():
    q = queue()
    assert not take(q, cont("a"), remote=15)  # its 16 tokens would finish after the remote 15
    assert take(q, cont("b"), remote=16)
    assert q.backlog_tokens == 16 and [r.rid for r in q.waiting] == ["b"]
    assert not take(q, cont("c"), remote=31)  # 16 waiting here + 16 > 31
    assert take(q, cont("d"), remote=32)
    assert q.backlog_tokens == 32


def test_refused_with_retracted_requests_without_room_or_with_the_policy_off():
    assert not take(queue(), cont("a"), remote=100, retracted=1)
    assert not take(queue(pages=5), cont("a"), remote=100)  # 4 pages of KV + its reservation > 5
    assert not take(queue(backlog_ratio=0.0), cont("a"), remote=100)
    assert take(queue(pages=12), cont("a"), remote=100)
