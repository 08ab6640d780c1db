"""benchmarks.moe_triton: the fused-MoE kernels and the torch expert loop timed side by side, run on CPU
in the Triton interpreter (``TRITON_INTERPRET`` set before anything imports triton)."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from benchmarks import moe_triton  # noqa: E402
from engine.kernels import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not importable")

SMALL = ["--device", "cpu", "--hidden", "40", "--experts", "8", "--top-k", "2", "--expert-size", "24", "--reps", "1"]


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("int8", 2e-2)])
def test_cli_prints_a_row_per_token_count_with_agreeing_outputs(capsys, dtype, bound):
    moe_triton.main([*SMALL, "--dtype", dtype, "--tokens", "1,3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| tokens | torch loop ms |") and len(lines) == 4
    for tokens, line in zip((1, 3), lines[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert int(cells[0]) == tokens and float(cells[1]) > 0 and float(cells[2]) > 0
        assert float(cells[4]) < bound
