"""benchmarks.swa_memory on a tiny hybrid: both layouts fit the budget, and past the window the SWA
pool admits more requests, each holding fewer KV bytes (the decode worker's admission code)."""

from __future__ import annotations

from benchmarks.swa_memory import admit_all, layouts
from tests.support.models import tiny_config

TYPES = ("sliding_attention",) * 5 + ("full_attention",)


def test_swa_pool_admits_more_requests_at_one_budget():
    mc = tiny_config(num_layers=6, sliding_window=16, layer_types=TYPES)
    budget = 4 * 2**20
    rows = {}
    for L in (12, 400):
        for lay in layouts(mc, budget, L, 8, 4, 4):
            assert lay.bytes <= budget
            rows[L, lay.name] = admit_all(mc, lay, L, 8, 4)
    # shorter than the window the SWA pool saves nothing; the split (sized for a whole window)
    # costs some requests: measured 194 vs 226
    assert 0.8 * rows[12, "full"][0] <= rows[12, "swa"][0] <= rows[12, "full"][0]
    n_full, b_full = rows[400, "full"]
    n_swa, b_swa = rows[400, "swa"]
    assert n_swa > 3 * n_full and b_swa / n_swa < b_full / n_full / 3
