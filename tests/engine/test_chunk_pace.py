"""``engine.scheduler.chunk_pace``: a step's prefill chunk sized from a fitted step cost
``F + c * rows`` so the step takes about ``step_s``, never so small that the fixed part ``F`` is
more than half of a step, within the caller's cap, never below the smallest chunk."""

from __future__ import annotations

import pytest

from engine.scheduler.chunk_pace import MIN_TOKENS, PROBE_TOKENS, WINDOW, ChunkPace

pytestmark = pytest.mark.unit


class Host:
    """A simulated host whose step of ``n`` rows takes ``fixed + row * n`` seconds."""

    def __init__(self, fixed: float, row: float) -> None:
        self.fixed, self.row = fixed, row

    def run(self, pace: ChunkPace, steps: int, cap: int = 512, rows: int = 0) -> list[tuple[int, float]]:
        """``steps`` steps paced by ``pace``: each one's prefill tokens and seconds."""
        out = []
        for _ in range(steps):
            n = pace.tokens(cap, rows)
            t = self.fixed + self.row * (n + rows)
            pace.observe(n, rows, t)
            out.append((n, t))
        return out


def test_off_gives_the_cap():
    pace = ChunkPace(0.0)
    pace.observe(512, 0, 15.0)
    assert pace.tokens(512, 0) == 512 and pace.tokens(100, 3) == 100


def test_an_unmeasured_host_gets_the_probe_within_the_cap():
    pace = ChunkPace(0.5)
    assert pace.tokens(512, 0) == PROBE_TOKENS and pace.tokens(8, 0) == 8


def test_one_timed_size_gives_its_rate_at_another_size():
    pace = ChunkPace(0.5)
    pace.observe(64, 0, 0.1)  # 640 rows/s, the fixed part unknown: 320 rows fit half a second
    assert pace.row_s is None and pace.tokens(512, 0) == 320
    assert pace.tokens(512, 20) == 288  # the decode rows take their share, rounded down to 16s
    assert pace.tokens(256, 0) == 256  # the cap still holds
    same = ChunkPace(0.5)
    same.observe(64, 0, 0.5)  # its rate gives the size just timed: twice it, to tell F from c
    assert same.tokens(512, 0) == 128 and same.tokens(100, 0) == 32  # half of it where twice is past the cap


def test_two_sizes_fit_the_fixed_and_the_row_cost():
    pace = ChunkPace(0.5)
    pace.observe(64, 0, 0.3 + 0.002 * 64)
    pace.observe(32, 0, 0.3 + 0.002 * 32)
    assert pace.fixed_s == pytest.approx(0.3) and pace.row_s == pytest.approx(0.002)
    assert pace.tokens(512, 0) == 160  # 150 rows make the fixed part half a step, rounded up to 16s
    assert pace.tokens(100, 0) == 100 and pace.tokens(512, 40) == 112


def test_a_large_fixed_cost_keeps_chunks_where_half_a_step_computes_rows():
    pace = ChunkPace(0.5)
    steps = Host(0.3, 0.002).run(pace, 12)  # 0.5 s fits 100 rows, where 0.3 s of each step is fixed
    assert all(n >= 0.3 / 0.002 for n, _ in steps[2:])
    assert all(t >= 2 * 0.3 for _, t in steps[2:])  # past step_s: half of each step computes rows


def test_a_slow_linear_host_gets_the_smallest_chunk_and_a_prompt_still_advances():
    pace = ChunkPace(0.5)
    Host(0.0, 1 / 35).run(pace, 4)  # the loaded 2-core host, no fixed part: 35 rows/s
    assert pace.tokens(512, 0) == MIN_TOKENS
    assert pace.tokens(512, 40) == MIN_TOKENS  # more decode rows than the budget: the chunk stays


def test_a_small_fixed_cost_settles_where_a_step_takes_step_s():
    pace = ChunkPace(0.5)
    steps = Host(0.02, 0.001).run(pace, 8)
    assert {n for n, _ in steps[3:]} == {480} and all(0.45 <= t <= 0.5 for _, t in steps[3:])
    assert Host(0.01, 0.0001).run(ChunkPace(0.5), 4)[1:] == [(512, 0.01 + 0.0001 * 512)] * 3  # fast: the cap


def test_a_load_change_moves_the_chunks_within_a_few_steps():
    host, pace = Host(0.02, 0.001), ChunkPace(0.5)
    host.run(pace, 8)
    host.row = 0.002  # the host's load doubles the row cost
    steps = host.run(pace, 6)
    assert all(n <= 240 and 0.4 <= t <= 0.5 for n, t in steps[2:])
    host.row = 0.001  # and halves it back
    assert host.run(pace, 6)[2:] == [(480, 0.02 + 0.48)] * 4
    big, pace = Host(0.3, 0.002), ChunkPace(0.5)
    big.run(pace, 8)
    big.row = 0.004  # the fixed part weighs less: smaller chunks are still efficient
    assert [n for n, _ in big.run(pace, 6)[2:]] == [80] * 4


def test_alike_sizes_keep_the_fitted_shape_scaled_to_their_times():
    pace = ChunkPace(0.5)
    Host(0.3, 0.002).run(pace, 14)  # fitted, then steps of 160 rows
    for _ in range(WINDOW):
        pace.observe(160, 0, 1.2 * (0.3 + 0.002 * 160))  # a fifth slower, every part alike
    assert pace.fixed_s == pytest.approx(0.36) and pace.row_s == pytest.approx(0.0024)


def test_timing_observes_the_forward_it_wraps_by_its_clock():
    now = [10.0]
    pace = ChunkPace(0.5, clock=lambda: now[0])
    with pace.timing(200, 56):
        now[0] += 2.0  # the forward: 256 rows in 2 s
    assert list(pace.steps) == [(256, 2.0)]
    assert pace.tokens(512, 0) == 64  # 128 rows/s x 0.5 s
