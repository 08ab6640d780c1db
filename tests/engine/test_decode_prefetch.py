"""How the decode step's memory-streaming kernels prefetch (engine/kernels/decode_prefetch.py): the
env override, the pick of the faster timed mode per kernel, the last-level cache read from sysfs
and the probes' size. That both modes give the same output is tested with each kernel
(test_cpu_attention.py, test_cpu_gemv.py)."""

from __future__ import annotations

import pytest

from engine.kernels import cpu_native, decode_prefetch
from engine.kernels.cpu_native import PREFETCH_L1, PREFETCH_L2
from engine.kernels.decode_prefetch import Modes

needs_kernel = pytest.mark.skipif(cpu_native.load() is None, reason="no C compiler for the CPU kernels")


@pytest.fixture
def fresh_modes(monkeypatch):
    """``modes()`` uncached before and after, with no override from the environment."""
    monkeypatch.delenv(decode_prefetch.ENV, raising=False)
    decode_prefetch.modes.cache_clear()
    yield
    decode_prefetch.modes.cache_clear()


def _no_timing(*_a, **_k):
    raise AssertionError("the override must not time anything")


@pytest.mark.parametrize("name,want", [("l1", PREFETCH_L1), (" L2 ", PREFETCH_L2)])
def test_env_sets_both_modes_without_timing(fresh_modes, monkeypatch, name, want):
    monkeypatch.setenv(decode_prefetch.ENV, name)
    monkeypatch.setattr(decode_prefetch, "time_attention", _no_timing)
    monkeypatch.setattr(decode_prefetch, "time_gemv", _no_timing)
    assert decode_prefetch.modes() == Modes(want, want)


def test_env_naming_no_mode_is_an_error_that_lists_the_modes(fresh_modes, monkeypatch):
    monkeypatch.setenv(decode_prefetch.ENV, "l3")
    with pytest.raises(ValueError, match="l1, l2"):
        decode_prefetch.modes()


@needs_kernel
def test_each_kernel_keeps_its_faster_mode_for_the_process(fresh_modes, monkeypatch):
    calls = []
    monkeypatch.setattr(
        decode_prefetch, "time_attention", lambda n: calls.append("attention") or {PREFETCH_L1: 2.0, PREFETCH_L2: 1.0}
    )
    monkeypatch.setattr(
        decode_prefetch, "time_gemv", lambda n: calls.append("gemv") or {PREFETCH_L1: 1.0, PREFETCH_L2: 1.5}
    )
    monkeypatch.setattr(cpu_native, "gemv_available", lambda: True)
    assert decode_prefetch.modes() == Modes(attention=PREFETCH_L2, gemv=PREFETCH_L1)
    assert decode_prefetch.modes() == Modes(attention=PREFETCH_L2, gemv=PREFETCH_L1)
    assert calls == ["attention", "gemv"]  # timed once


@needs_kernel
def test_without_the_matmul_kernel_only_attention_is_timed(fresh_modes, monkeypatch):
    monkeypatch.setattr(decode_prefetch, "time_attention", lambda n: {PREFETCH_L1: 2.0, PREFETCH_L2: 1.0})
    monkeypatch.setattr(decode_prefetch, "time_gemv", _no_timing)
    monkeypatch.setattr(cpu_native, "gemv_available", lambda: False)
    assert decode_prefetch.modes() == Modes(attention=PREFETCH_L2, gemv=PREFETCH_L1)


@needs_kernel
def test_the_probes_time_both_modes_on_real_data():
    for times in (
        decode_prefetch.time_attention(8 << 20, rounds=1),
        *([decode_prefetch.time_gemv(8 << 20, rounds=1)] if cpu_native.gemv_available() else []),
    ):
        assert set(times) == {PREFETCH_L1, PREFETCH_L2}
        assert all(0 < t < 10 for t in times.values())


def test_last_level_cache_is_the_highest_level_in_sysfs(tmp_path):
    for index, level, size in (("index0", 1, "32K"), ("index2", 2, "1024K"), ("index3", 3, "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    assert decode_prefetch.last_level_cache_bytes(tmp_path) == 32 << 20
    assert decode_prefetch.last_level_cache_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize(
    "llc,want", [(None, 64 << 20), (16 << 20, 64 << 20), (96 << 20, 192 << 20), (512 << 20, 256 << 20)]
)
def test_probe_reads_twice_the_cache_within_bounds(llc, want):
    assert decode_prefetch.probe_bytes(llc) == want
