"""engine.cpu_linear: CPU float32 weights are packed for oneDNN and give F.linear's result (up to
float32 rounding) at decode and prefill row counts (padded to a bucket, chunked past CHUNK_ROWS),
with bias and batched inputs; warm-up covers every bucket once per shape; other weights stay plain
tensors and go through F.linear unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu_linear import CHUNK_ROWS, ROW_BUCKETS, PackedWeight, bucket_rows, has_fast_bf16, linear, pack, warm_up


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 8, 33, 512, 1300])
def test_packed_linear_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    p = pack(w)
    assert isinstance(p, PackedWeight) and p.shape == w.shape
    torch.testing.assert_close(linear(x, p), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(x, p, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = x.view(1, rows, 64).expand(2, rows, 64)
    assert linear(x3, p).shape == (2, rows, 96)
    torch.testing.assert_close(
        linear(x[:, ::2].repeat(1, 2), p), F.linear(x[:, ::2].repeat(1, 2), w), rtol=1e-5, atol=1e-4
    )


def test_other_weights_stay_plain():
    w16 = torch.randn(8, 4).to(torch.float16)
    assert pack(w16) is w16
    assert pack(torch.randn(3)).dim() == 1  # not a matrix
    x = torch.randn(2, 4).to(torch.float16)
    assert torch.equal(linear(x, w16), F.linear(x, w16))


@pytest.mark.parametrize("fast", [True, False])
def test_bfloat16_weights_are_packed_only_where_the_cpu_has_bf16_instructions(monkeypatch, fast):
    if fast and not has_fast_bf16():
        pytest.skip("this CPU has no bfloat16 instructions: oneDNN cannot pack bfloat16 weights here")
    monkeypatch.setattr("engine.cpu_linear.has_fast_bf16", lambda: fast)
    w = torch.randn(96, 64).to(torch.bfloat16)
    p = pack(w)
    assert isinstance(p, PackedWeight) == (fast and torch.backends.mkldnn.is_available())
    if isinstance(p, PackedWeight):
        x, b = torch.randn(5, 64).to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
        # both accumulate in float32 and round once to bfloat16: at most one bfloat16 ulp apart
        torch.testing.assert_close(linear(x, p, b).float(), F.linear(x, w, b).float(), rtol=1e-2, atol=2e-2)
        assert warm_up([(p, b)], max_rows=8) == ROW_BUCKETS.index(8) + 1


def test_row_buckets_cover_every_count_up_to_a_chunk():
    assert ROW_BUCKETS[-1] == CHUNK_ROWS and list(ROW_BUCKETS) == sorted(set(ROW_BUCKETS))
    for rows in range(1, CHUNK_ROWS + 1):
        b = bucket_rows(rows)
        assert b >= rows and b in ROW_BUCKETS
        assert ROW_BUCKETS.index(b) == 0 or ROW_BUCKETS[ROW_BUCKETS.index(b) - 1] < rows
    with pytest.raises(IndexError):
        bucket_rows(CHUNK_ROWS + 1)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_empty_input_and_warm_up():
    w, b = torch.randn(24, 16), torch.randn(24)
    p = pack(w)
    assert linear(torch.empty(0, 16), p).shape == (0, 24)
    # two weights of one shape count once; a bias makes another shape; plain weights are skipped
    assert warm_up([(p, None), (pack(w.clone()), None), (p, b), (w, None)]) == 2 * len(ROW_BUCKETS)
    assert warm_up([(p, None)], max_rows=64) == ROW_BUCKETS.index(64) + 1
