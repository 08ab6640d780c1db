"""benchmarks.decode_attention: the decode attention kernel timed with float32 math and bfloat16 products."""

from __future__ import annotations

import pytest

from benchmarks import decode_attention
from engine.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler for the CPU kernels")


def test_measure_times_both_paths_and_compares_their_outputs():
    got = decode_attention.measure(2, 40, reps=1)
    dots = {False, True} if cpu_native.decode_dot_available() else {False}
    assert set(got["ms"]) == dots and all(ms > 0 for ms in got["ms"].values())
    assert got["mb"] == pytest.approx(2 * 40 * 3 * 64 * 2 * 2 * 30 / 1e6)
    if True in dots:  # one bfloat16 rounding of the weights: small, not nothing
        assert 0 < got["rel"] < 1e-2
    else:
        assert got["rel"] == 0


def test_cli_prints_a_row_per_shape(capsys):
    decode_attention.main(["--shapes", "1x20,3x33", "--reps", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| batch x context |") and len(lines) == 4
    assert lines[2].startswith("| 1x20 | ") and lines[3].startswith("| 3x33 | ")
