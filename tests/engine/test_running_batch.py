"""``RunningBatch.absorb``: which requests leave the batch after a step's deltas."""

from __future__ import annotations

from configs.scheduler import SchedulerConfig
from engine.request import Phase, Request
from engine.scheduler.running_batch import DecodeResult, RunningBatch
from engine.scheduler.stats import SchedulerStats
from transfer.wire.protocol import TokenDelta
from transfer.wire.sampling_params import SamplingParams


def batch_of(*reqs: Request) -> RunningBatch:
    batch = RunningBatch(kv=None, executor=None, cfg=SchedulerConfig(), stats=SchedulerStats())
    for r in reqs:
        batch.add(r)
    return batch


def request(rid: str) -> Request:
    return Request(rid=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=8), sampler_state=None)


def delta(req: Request, token: int, finish_reason: str | None = None) -> TokenDelta:
    return TokenDelta(rid=req.rid, token_ids=[token], finish_reason=finish_reason)


def test_a_request_finished_without_a_finish_reason_leaves_the_batch():
    """A request finished during the step (an abort) whose delta carries no finish reason must
    still leave: a request left in the batch while finished would be decoded forever."""
    live, aborted = request("live"), request("aborted")
    batch = batch_of(live, aborted)
    aborted.status = Phase.FINISHED
    res = DecodeResult()
    batch.absorb(res, [(live, delta(live, 5)), (aborted, delta(aborted, 6))])
    assert list(batch) == [live]
    assert res.finished == [aborted]
    assert [d.token_ids for _, d in res.tokens] == [[5], [6]]


def test_a_speculative_row_leaves_on_its_last_delta_only():
    """A row with several deltas (accepted drafts) leaves once, after its last delta."""
    spec, other = request("spec"), request("other")
    batch = batch_of(spec, other)
    spec.status = Phase.FINISHED
    res = DecodeResult()
    steps = [(spec, delta(spec, 1)), (spec, delta(spec, 2)), (spec, delta(spec, 3, "stop")), (other, delta(other, 4))]
    batch.absorb(res, steps)
    assert list(batch) == [other]
    assert res.finished == [spec]
    assert batch.stats.generation_tokens == 4
