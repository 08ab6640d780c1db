"""A prefill worker's chunks fit ``prefill_step_s`` at the rate its steps were measured at
(``engine.scheduler.chunk_pace``), so a withdrawal (a decode worker switching role takes its
prompts back) that arrives during a long prompt is answered after one short chunk at most: the
worker loop reads messages between two steps. With the real schedulers in one process
(``PDHarness``: 1 prefill + 1 decode worker, loopback transport, the tiny model) on a simulated
slow host (a clock each prefill forward advances by its tokens over the host's rate): the chunks
shrink to the step budget, the withdrawal is answered at the end of the step it arrived in, and
outputs, paced or re-sent after the withdrawal, equal transformers."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from engine.scheduler.chunk_pace import MIN_TOKENS, PROBE_TOKENS
from prefill_worker.withdraw import RELEASED
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from tests.support.withdraw import ask_back, reserve
from transfer.wire.protocol import PrefillFailed

pytestmark = pytest.mark.unit

RATE = 40.0  # prompt tokens per second of the simulated host: 512 take 12.8 s, as on a loaded 2-core CPU
STEP_S = 0.5
PROMPT = pd_prompts(1, 300, 300, seed=71)[0]


class SlowHost:
    """Makes ``p``'s prefill forwards take their tokens / ``rate`` seconds on the clock its pace
    reads; ``chunks``: each forward's tokens, ``ends``: the clock at each forward's end."""

    def __init__(self, p, rate: float) -> None:
        self.now, self.chunks, self.ends = 0.0, [], []
        extend = p.executor.extend

        def timed(items):
            n = sum(i.length for i in items)
            self.now += n / rate
            self.chunks.append(n)
            self.ends.append(self.now)
            return extend(items)

        p.executor.extend = timed
        p.pace.clock = lambda: self.now

    def longest_step_s(self) -> float:
        return max(self.chunks) / RATE


def _decode_cfg():
    """The decode worker prefills nothing itself: every prompt goes to the prefill worker."""
    c = pd_cfg()
    c.cluster.local_prefill_backlog_ratio = 0.0
    return c


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(
        lambda step_s: PDHarness(pd_cfg(prefill_step_s=step_s), _decode_cfg(), tiny[0], tiny[1])
    )


@pytest.mark.slow
def test_paced_chunks_fit_the_step_budget_and_outputs_equal_transformers(harness, tiny):
    h = harness(STEP_S)
    host = SlowHost(h.prefill, RATE)
    h.submit("r", PROMPT, GREEDY)
    assert h.run()["r"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)
    assert sum(host.chunks) == len(PROMPT)
    # an unmeasured host gets the probe, then chunks of what half a second computes at 40 tokens/s
    assert host.chunks[0] == PROBE_TOKENS and set(host.chunks[1:-1]) == {MIN_TOKENS}
    assert host.longest_step_s() <= PROBE_TOKENS / RATE


@pytest.mark.slow
def test_a_withdrawal_during_a_long_prompt_is_answered_after_one_paced_chunk(harness, tiny):
    h = harness(STEP_S)
    host = SlowHost(h.prefill, RATE)
    reserve(h, "r", PROMPT, GREEDY)
    while not (h.prefill.admission.chunked is not None and len(host.chunks) >= 3):
        h.step()  # the probe, then paced chunks: the prompt is part computed
    job = h.prefill.jobs[(1, 0)]
    assert 0 < job.req.kv_len < len(PROMPT) and not job.writing
    arrived = host.now  # the withdrawal comes as the next step starts: the longest it can wait
    h.step()
    [answer] = ask_back(h)  # read between two steps
    assert answer == PrefillFailed(rid="r", room=1, generation=0, error=RELEASED, error_status=503)
    assert host.now - arrived == pytest.approx(MIN_TOKENS / RATE) and MIN_TOKENS / RATE <= STEP_S  # one paced chunk
    [d] = h._exchange()
    assert d.handed_back and d.error_status == 503 and not h.decode.jobs
    h.submit("r~1", PROMPT, GREEDY)  # the router's re-send: the withdrawn prompt, computed on, is cached
    assert h.run()["r~1"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)
    assert h.prefill.withdrawn == 1 and max(host.chunks[1:]) <= STEP_S * RATE


@pytest.mark.slow
def test_without_the_step_budget_the_whole_prompt_is_one_step(harness, tiny):
    """The case the budget is for: off, the 300-token prompt is one forward of 7.5 s on the slow
    host, and a withdrawal that arrives meanwhile waits for all of it."""
    h = harness(0.0)
    host = SlowHost(h.prefill, RATE)
    h.submit("r", PROMPT, GREEDY)
    assert h.run()["r"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)
    assert host.chunks == [len(PROMPT)] and host.longest_step_s() == len(PROMPT) / RATE
