"""A decode worker's own prefill is cut into chunks that fit ``prefill_step_s`` at the rate its
steps were measured at (``engine.scheduler.chunk_pace``), so a role switch that arrives during a
long local prefill waits for one short chunk at most: the worker loop reads control messages
between two steps. In one process (1 prefill + 2 decode workers, loopback transports, the tiny
model) on a simulated slow host (a clock each forward advances by its rows over the host's rate):
the chunks shrink to the step budget, the switch hands the partly prefilled request back at its
next step with nothing computed after it came and every page freed, and outputs, paced or re-sent,
equal transformers."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import checked_harnesses
from decode_worker.evacuate import SWITCHING_AWAY, evacuate, start
from decode_worker.jobs import DecodeState
from engine.scheduler.chunk_pace import MIN_TOKENS, PROBE_TOKENS
from tests.support.migration_harness import MigrationHarness
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts

pytestmark = pytest.mark.unit

RATE = 40.0  # rows per second of the simulated host: 512 tokens take 12.8 s, as on a loaded 2-core CPU
STEP_S = 0.5


class SlowHost:
    """Makes ``d``'s forwards take (decode rows + prefill tokens) / ``rate`` seconds on the clock
    its local prefill is timed by; ``chunks``: each forward's prefill tokens."""

    def __init__(self, d, rate: float) -> None:
        self.now, self.chunks = 0.0, []
        mixed = d.executor.mixed

        def timed(rows, items):
            n = sum(i.length for i in items)
            self.now += (len(rows) + n) / rate
            self.chunks.append(n)
            return mixed(rows, items)

        d.executor.mixed = timed
        d.local.pace.clock = lambda: self.now

    def longest_step_s(self) -> float:
        return max(self.chunks) / RATE


def _d1(step_s: float):
    """d1: prefills prompts up to 512 tokens itself, switchable (a migration path that moves nothing on its own)."""
    c = pd_cfg(prefill_step_s=step_s)
    c.cluster.local_prefill_max_tokens = 512
    c.cluster.local_prefill_backlog_ratio = 0.0
    c.cluster.migrate_after = "100000"
    return c


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda step_s: MigrationHarness(pd_cfg(), _d1(step_s), pd_cfg(), tiny[0], tiny[1]))


PROMPT = pd_prompts(1, 300, 300, seed=61)[0]


@pytest.mark.slow
def test_paced_chunks_fit_the_step_budget_and_outputs_equal_transformers(harness, tiny):
    h = harness(STEP_S)
    host = SlowHost(h.d1, RATE)
    h.submit("r", PROMPT, GREEDY)
    assert h.d1.jobs["r"].state is DecodeState.LOCAL_PREFILL
    out = h.run()
    assert out["r"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16) and out["r"]["from"] == ["d1"] * 16
    prefill = [n for n in host.chunks if n]
    assert sum(prefill) == len(PROMPT) == h.d1.local.tokens
    # an unmeasured host gets the probe, then chunks of what half a second computes at 40 rows/s
    assert prefill[0] == PROBE_TOKENS and set(prefill[1:-1]) == {MIN_TOKENS}
    assert host.longest_step_s() <= PROBE_TOKENS / RATE


@pytest.mark.slow
def test_a_switch_during_a_long_local_prefill_is_taken_after_one_chunk(harness, tiny):
    h = harness(STEP_S)
    host = SlowHost(h.d1, RATE)
    h.submit("r", PROMPT, GREEDY)
    for _ in range(4):
        h.step()
    job = h.d1.jobs["r"]
    assert job.state is DecodeState.LOCAL_PREFILL and 0 < job.req.kv_len < len(PROMPT)  # partly prefilled
    computed, clock = sum(host.chunks), host.now
    assert clock <= 4 * PROBE_TOKENS / RATE  # four steps of at most the probe's time each
    assert start(h.d1) is None  # the SwitchRole, read between two steps
    evacuate(h.d1)  # what the role switcher does before each turn
    h.step()
    # handed back at once: no token, a 503 the router answers by sending it to another pair
    assert "r" not in h.d1.jobs and h.out["r"]["tokens"] == []
    assert h.out["r"]["handed_back"] and h.out["r"]["error"] == SWITCHING_AWAY
    assert sum(host.chunks) == computed and h.d1.kv.usage([]).used == 0 and not h.d1.local
    assert h.d1.held_rids() == set()  # nothing holds the switch up
    h.submit("r~1", PROMPT, GREEDY, decode="d2")  # the router's re-send
    assert h.run()["r~1"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)


@pytest.mark.slow
def test_without_the_step_budget_the_whole_prompt_is_one_step(harness, tiny):
    """The case the budget is for: off, the 300-token prompt is one forward of 7.5 s on the slow
    host, and a switch that arrives meanwhile waits for all of it."""
    h = harness(0.0)
    host = SlowHost(h.d1, RATE)
    h.submit("r", PROMPT, GREEDY)
    assert h.run()["r"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)
    assert [n for n in host.chunks if n] == [len(PROMPT)] and host.longest_step_s() == len(PROMPT) / RATE
