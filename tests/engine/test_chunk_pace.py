"""``engine.scheduler.chunk_pace``: a step's prefill chunk sized from the measured rate so the step
takes about ``step_s``, within the caller's cap, never below the smallest chunk."""

from __future__ import annotations

import pytest

from engine.scheduler.chunk_pace import MIN_TOKENS, PROBE_TOKENS, ChunkPace

pytestmark = pytest.mark.unit


def test_off_gives_the_cap():
    pace = ChunkPace(0.0)
    pace.observe(512, 0, 15.0)
    assert pace.tokens(512, 0) == 512 and pace.tokens(100, 3) == 100


def test_an_unmeasured_host_gets_the_probe_within_the_cap():
    pace = ChunkPace(0.5)
    assert pace.tokens(512, 0) == PROBE_TOKENS and pace.tokens(8, 0) == 8


def test_the_chunk_fits_the_step_time_at_the_measured_rate():
    pace = ChunkPace(0.5)
    pace.observe(64, 0, 0.1)  # 640 rows/s: 320 rows fit half a second
    assert pace.tokens(512, 0) == 320
    assert pace.tokens(512, 20) == 288  # the decode rows take their share, rounded down to 16s
    assert pace.tokens(256, 0) == 256  # the cap still holds


def test_a_slow_host_gets_the_smallest_chunk_and_a_prompt_still_advances():
    pace = ChunkPace(0.5)
    pace.observe(512, 0, 14.7)  # the loaded 2-core host: 35 rows/s
    assert pace.tokens(512, 0) == MIN_TOKENS
    assert pace.tokens(512, 40) == MIN_TOKENS  # more decode rows than the budget: the chunk stays


def test_the_rate_follows_the_latest_steps():
    pace = ChunkPace(1.0)
    pace.observe(100, 0, 1.0)
    pace.observe(300, 0, 1.0)
    assert pace.rate == pytest.approx(200.0)
    pace.observe(0, 5, 1.0)  # a step without prefill says nothing of the prefill rate
    assert pace.rate == pytest.approx(200.0)
    for _ in range(20):
        pace.observe(40, 0, 1.0)
    assert pace.tokens(512, 0) == 32


def test_timing_observes_the_forward_it_wraps_by_its_clock():
    now = [10.0]
    pace = ChunkPace(0.5, clock=lambda: now[0])
    with pace.timing(200, 56):
        now[0] += 2.0  # the forward: 256 rows in 2 s
    assert pace.rate == pytest.approx(128.0)
    assert pace.tokens(512, 0) == 64  # 128 rows/s x 0.5 s
