"""The decode attention kernel's row prefetch mode: the env override, the pick of the faster timed
mode, the last-level cache read from sysfs and the probe's size (engine/kernels/decode_prefetch.py).
That both modes give the same output is tested with the kernel (test_cpu_attention.py)."""
from __future__ import annotations

import pytest

from engine.kernels import cpu_native, decode_prefetch
from engine.kernels.cpu_native import PREFETCH_L1_FAR, PREFETCH_L2_NEAR


@pytest.fixture
def fresh_mode(monkeypatch):
    """``mode()`` uncached before and after, with no override from the environment."""
    monkeypatch.delenv(decode_prefetch.ENV, raising=False)
    decode_prefetch.mode.cache_clear()
    yield
    decode_prefetch.mode.cache_clear()


def _no_timing(*_a, **_k):
    raise AssertionError("the override must not time anything")


@pytest.mark.parametrize("name,want", [("l1-far", PREFETCH_L1_FAR), ("L2-Near", PREFETCH_L2_NEAR)])
def test_env_sets_the_mode_without_timing(fresh_mode, monkeypatch, name, want):
    monkeypatch.setenv(decode_prefetch.ENV, name)
    monkeypatch.setattr(decode_prefetch, "time_modes", _no_timing)
    assert decode_prefetch.mode() == want


def test_env_naming_no_mode_is_an_error_that_lists_the_modes(fresh_mode, monkeypatch):
    monkeypatch.setenv(decode_prefetch.ENV, "l3")
    with pytest.raises(ValueError, match="l1-far, l2-near"):
        decode_prefetch.mode()


@pytest.mark.parametrize("times,want", [({PREFETCH_L1_FAR: 2.0, PREFETCH_L2_NEAR: 1.0}, PREFETCH_L2_NEAR),
                                        ({PREFETCH_L1_FAR: 1.0, PREFETCH_L2_NEAR: 1.5}, PREFETCH_L1_FAR)])
def test_the_faster_timed_mode_is_kept_for_the_process(fresh_mode, monkeypatch, times, want):
    if cpu_native.load() is None:
        pytest.skip("no C compiler for the CPU kernel")
    calls = []
    monkeypatch.setattr(decode_prefetch, "time_modes", lambda nbytes: calls.append(nbytes) or times)
    assert decode_prefetch.mode() == want
    assert decode_prefetch.mode() == want
    assert len(calls) == 1  # timed once


@pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler for the CPU kernel")
def test_time_modes_times_both_modes_on_a_real_pool():
    times = decode_prefetch.time_modes(8 << 20, rounds=1)
    assert set(times) == {PREFETCH_L1_FAR, PREFETCH_L2_NEAR}
    assert all(0 < t < 10 for t in times.values())


def test_last_level_cache_is_the_highest_level_in_sysfs(tmp_path):
    for index, level, size in (("index0", 1, "32K"), ("index2", 2, "1024K"), ("index3", 3, "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert decode_prefetch.last_level_cache_bytes(tmp_path) == 32 << 20
    assert decode_prefetch.last_level_cache_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize("llc,want", [(None, 64 << 20), (16 << 20, 64 << 20), (96 << 20, 192 << 20),
                                      (512 << 20, 256 << 20)])
def test_probe_reads_twice_the_cache_within_bounds(llc, want):
    assert decode_prefetch.probe_bytes(llc) == want
