"""PD mode with the SWA pool, in one process (real schedulers, loopback transport): outputs equal
transformers' Ministral; the decode worker preallocates and receives only the SWA tail; a
multi-turn chat's second turn ships only its new tokens; retract offloads the window and resumes."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from cache.swa_window import NO_PAGE
from configs.schema import PdserveConfig
from tests.support.swa import PAGE, hf_reference, swa_prompts
from transfer.wire.sampling_params import SamplingParams


def cfg(pool=1024, swa=256, host_gb=0.01, radix=True, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": PAGE, "swa_pool_tokens": swa},
            "scheduler": {"enable_radix_cache": radix, **sched},
            "cluster": {"mode": "pd", "host_kv_pool_gb": host_gb, "transfer_backend": "loopback"},
        }
    )


@pytest.fixture
def harness(swa_model):
    yield from checked_harnesses(
        lambda p=None, d=None: PDHarness(p or cfg(), d or cfg(), swa_model[0], swa_model[1], eos=(96,))
    )


def run(h: PDHarness, batch, n: int, tag: str = "r"):
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    for i, p in enumerate(batch):
        h.submit(f"{tag}{i}", p, params)
    out = h.run()
    return [out[f"{tag}{i}"]["tokens"] for i in range(len(batch))]


@pytest.mark.slow
@pytest.mark.parametrize("radix", [True, False])
def test_pd_swa_matches_transformers(harness, swa_model, radix):
    h = harness(d=cfg(radix=radix))
    batch = swa_prompts(3, 43, shared=20)
    assert run(h, batch, 10) == [hf_reference(swa_model[2], p, 10)[0] for p in batch]
    assert h.decode.kv.swa_pages_released > 0 and h.prefill.kv.swa_pages_released > 0


def test_decode_preallocates_only_the_swa_tail(harness):
    h = harness()
    p = swa_prompts(1, 43)[0]
    h.submit("t", p, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    h.step()
    job = h.decode.jobs["t"]
    start = h.decode.kv.window.prealloc_start(43, radix=True) // PAGE
    assert job.req.kv.swa_pages[:start] == [NO_PAGE] * start
    assert min(job.req.kv.swa_pages[start:]) >= 0 and len(job.req.kv.pages) == 11
    h.run()


@pytest.mark.slow
def test_second_turn_ships_only_its_new_tokens(harness, swa_model):
    h = harness()
    turn1 = swa_prompts(1, 30)[0]
    out1 = run(h, [turn1], 9, "a")[0]
    bytes1 = h.prefill.transfer_bytes
    turn2 = turn1 + out1 + swa_prompts(1, 6)[0]
    assert run(h, [turn2], 6, "b")[0] == hf_reference(swa_model[2], turn2, 6)[0]
    kv_len = len(turn1) + len(out1) - 1  # KV the first turn's decode left behind
    assert h.decode.stats.cached_prompt_tokens == (kv_len // PAGE) * PAGE
    shipped_pages = -(-len(turn2) // PAGE) - kv_len // PAGE
    unit = h.p_runner.pools.unit_bytes
    swa = h.decode.kv.usage([], "swa")
    assert h.prefill.transfer_bytes - bytes1 <= 2 * shipped_pages * unit < bytes1
    assert swa.cached > 0


@pytest.mark.slow
def test_forced_retract_offloads_the_window_and_resumes(harness, swa_model):
    h = harness(d=cfg(retract_test_interval=3))
    batch = swa_prompts(3, 35)
    assert run(h, batch, 12) == [hf_reference(swa_model[2], p, 12)[0] for p in batch]
    st = h.decode.retract.stats
    assert st.resumed > 0 and st.offloaded > 0
    # offload holds the full pages and the window only: fewer rows than two pools of full pages
    assert st.offload_bytes < st.offloaded * 2 * (-(-47 // PAGE)) * h.d_runner.pools.unit_bytes


@pytest.mark.slow
def test_recompute_when_the_host_pool_is_off(harness, swa_model):
    h = harness(d=cfg(retract_test_interval=3, host_gb=0.0))
    batch = swa_prompts(2, 35)
    assert run(h, batch, 10) == [hf_reference(swa_model[2], p, 10)[0] for p in batch]
    assert h.decode.retract.stats.recomputed > 0


@pytest.fixture(scope="module")
def swa_folder(swa_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-ministral")
    swa_model[2].save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.process  # worker subprocesses (PDPair)
def test_pd_processes_swa_pool_over_nixl_with_offload(swa_model, swa_folder):
    """Real worker processes and NIXL: the SWA tail crosses as unit rows into the decode worker's
    SWA pool; a small decode pool retracts (offload of the window) and outputs stay exact."""
    from tests.support.pd_processes import SLOW_DECODE, PDPair, until_eos, wait_idle

    pair = PDPair(
        swa_folder,
        decode_pool=96,
        host_gb=0.01,
        init_new_token_ratio=0.1,
        decode_sched=SLOW_DECODE,
        engine={"swa_pool_tokens": 64},
    )
    try:
        batch = swa_prompts(4, 22, shared=8)
        params = SamplingParams(max_new_tokens=14, temperature=0)  # no ignore_eos: admission overcommits
        for i, p in enumerate(batch):
            pair.submit(f"s{i}", p, params)
        out = pair.collect([f"s{i}" for i in range(4)], timeout=120)
        want = [until_eos(hf_reference(swa_model[2], p, 14)[0]) for p in batch]
        assert [out[f"s{i}"]["tokens"] for i in range(4)] == want
        d, p = wait_idle(pair, "d0"), wait_idle(pair, "p0")
        assert d.counters["retractions"] > 0 and d.counters["retract_resumed"] > 0
        assert d.counters["swa_pages_released"] > 0 and d.gauges["swa_pages_total"] == 64 // PAGE
        assert d.gauges["swa_pages_used"] == 0 and d.gauges["kv_pages_used"] == 0
        assert d.gauges["host_kv_pool_bytes_used"] == 0 and p.gauges["swa_pages_used"] == 0
    finally:
        pair.close()
