"""The prefill worker counts the wall seconds of its prefill forwards (``prefill_compute_seconds``,
shipped in its heartbeat next to ``prefill_computed_tokens``: the planner's prefill speed): a batch
of several prompts counts its time once, so the count stays within the run's wall time and below the
per-prompt compute times summed."""

from __future__ import annotations

import time

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from configs.schema import PdserveConfig
from server.worker.loop import worker_stats
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=2, temperature=0)


def cfg() -> PdserveConfig:
    return PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda: PDHarness(cfg(), cfg(), tiny[0], tiny[1]))


def test_prefill_forward_seconds_count_a_shared_batch_once(harness):
    h = harness()
    t0 = time.perf_counter()
    for i in range(4):
        h.submit(f"r{i}", list(range(3 + i, 40 + i)), GREEDY)
    done = h.run()
    wall = time.perf_counter() - t0
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    stats = h.prefill.stats
    assert stats.prefill_computed_tokens == 4 * 37
    per_prompt = h.prefill.timeline.histograms["phase_prefill_compute"]
    assert per_prompt.count == 4
    assert 0 < stats.prefill_compute_seconds <= wall
    assert stats.prefill_compute_seconds < per_prompt.sum  # the prompts shared batches
    beat = worker_stats(h.prefill, "p0", "harness", "m")
    assert beat.counters["prefill_compute_seconds"] == pytest.approx(stats.prefill_compute_seconds)
