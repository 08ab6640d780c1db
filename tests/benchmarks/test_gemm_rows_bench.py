"""benchmarks.gemm_rows: the matmul-by-rows microbenchmark measures the serving path's projections."""

from __future__ import annotations

from benchmarks import gemm_rows


def test_measure_times_every_row_count_and_counts_the_flops():
    got = gemm_rows.measure([4, 16], "float32", reps=1)
    assert [m for m, _, _ in got] == [4, 16]
    for m, ms, gflops in got:
        assert ms > 0
        # GFLOP/s is the four projections' FLOPs over 30 layers for m rows, over the step's time
        flops = sum(2 * o * i for o, i in gemm_rows.SHAPES) * gemm_rows.LAYERS * m
        assert abs(gflops - flops / (ms / 1e3) / 1e9) <= 1e-6 * gflops


def test_cli_prints_one_row_per_thread_count_and_row_count(capsys):
    gemm_rows.main(["--rows", "8", "--threads", "1", "--dtype", "float32", "--reps", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| threads | rows |") and len(lines) == 3
    assert lines[2].startswith("| 1 | 8 | ")


def test_kernels_mode_times_each_kernel_it_can_run_at_each_row_count():
    import pytest

    from engine.kernels import cpu_native

    if not cpu_native.pairs_available():
        pytest.skip("no AVX512-BF16: the small-batch kernels are not built here")
    got = gemm_rows.measure_kernels([2, 16], ["onednn", "pairs", "gemv", "pairs-int8", "panels-f32"], reps=1)
    assert [(m, k) for m, k, _ in got] == [
        (2, "onednn"),
        (2, "pairs"),
        (2, "gemv"),
        (2, "pairs-int8"),
        (2, "panels-f32"),
        (16, "onednn"),
        (16, "pairs"),
        (16, "pairs-int8"),
        (16, "panels-f32"),
    ]  # gemv: <= 8 rows
    assert all(ms > 0 for _, _, ms in got)
