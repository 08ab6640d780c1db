"""Every worker series the router exports moves by the amount its workload implies.

The schedulers run in process (tiny model); their ``WorkerStats`` go through the router's own
``WorkerCollector`` and the Prometheus text format, so what is checked is what a scraper reads.
``COVERED`` must name every exported worker series: adding one without a test here fails.
"""

from __future__ import annotations

import os
import random

import pytest

from bench.harness.pd_harness import PDHarness
from configs.schema import PdserveConfig
from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.base import RequestRejected
from engine.scheduler.colocated import ColocatedScheduler
from server.router.metrics import WORKER_COUNTERS, WORKER_HISTOGRAMS
from server.worker.core_lending import CoreLedger, CoreLending
from tests.support.metrics_scrape import scrape, val
from tests.support.models import engine_cfg, sched_cfg, tiny_config, tiny_weights
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

GAUGES = {
    "pdserve_kv_pool_pages",
    "pdserve_kv_pool_capacity_pages",
    "pdserve_queue_requests",
    "pdserve_new_token_ratio",
    "pdserve_host_kv_pool_bytes",
    "pdserve_worker_stats_age_seconds",
    "pdserve_worker_up",
    "pdserve_swa_pool_pages",
    "pdserve_swa_pool_capacity_pages",
    "pdserve_worker_torch_threads",
    "pdserve_kv_sources",
}  # tests/router/test_kv_sources.py
COVERED = {
    *(n for n, _ in WORKER_COUNTERS.values()),
    *(n for n, _ in WORKER_HISTOGRAMS.values()),
    "pdserve_request_phase_seconds",
    "pdserve_migrations",
    "pdserve_local_prefill",  # tests/decode_worker/test_migration.py,
    *GAUGES,
}  # tests/decode_worker/test_local_prefill.py (local_prefill_tokens too)
OUT = 16


def prompts(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(0, 96) for _ in range(length)] for _ in range(n)]


def greedy(n=OUT):
    return SamplingParams(max_new_tokens=n, temperature=0)


def swa_scheduler(window=8, **sched) -> ColocatedScheduler:
    """A colocated scheduler over a tiny sliding/full hybrid with an SWA pool of 16 pages."""
    cfg = tiny_config(num_layers=4, sliding_window=window, layer_types=("sliding_attention", "full_attention") * 2)
    runner = ModelRunner(engine_cfg(kv_pool_tokens=256, page_size=4, swa_pool_tokens=64), cfg, tiny_weights(cfg))
    return ColocatedScheduler(runner, sched_cfg(**sched), ())


def lending_pair() -> tuple[CoreLending, CoreLedger]:
    """A borrower (1 thread, 2 when the other slot is idle) in a 2-slot ledger; threads not applied."""
    ledger, fd = CoreLedger.create(2)
    os.close(fd)
    return CoreLending(ledger, 0, own=1, total=2, set_threads=lambda n: None), ledger


def test_core_lending_series(tiny):
    """Each step run while the peer slot is idle counts once; the gauge is the latest step's threads."""
    sched = ColocatedScheduler(
        ModelRunner(engine_cfg(kv_pool_tokens=64, page_size=4), tiny[0], tiny[1]), sched_cfg(), ()
    )
    cores, ledger = lending_pair()
    m = scrape(sched, cores={0: cores})
    assert val(m, "pdserve_worker_borrowed_core_steps_total", worker="w0") == 0
    assert val(m, "pdserve_worker_torch_threads", worker="w0") == 1
    for _ in range(3):
        cores.begin_step()
    m = scrape(sched, cores={0: cores})
    assert val(m, "pdserve_worker_borrowed_core_steps_total", worker="w0") == 3
    assert val(m, "pdserve_worker_torch_threads", worker="w0") == 2
    ledger.set_busy(1, True)
    cores.begin_step()
    m = scrape(sched, cores={0: cores})
    assert val(m, "pdserve_worker_borrowed_core_steps_total", worker="w0") == 3
    assert val(m, "pdserve_worker_torch_threads", worker="w0") == 1
    assert not [k for k in scrape(sched) if k[0] == "pdserve_worker_torch_threads"]  # only with lending


def test_every_exported_worker_series_is_covered_here(tiny):
    sched = ColocatedScheduler(
        ModelRunner(engine_cfg(kv_pool_tokens=64, page_size=4), tiny[0], tiny[1]),
        sched_cfg(speculative_method="ngram"),  # its acceptance histogram: tests/engine/test_spec_metrics.py
        (),
    )
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    names = {
        n.removesuffix("_total").removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
        for n, _ in scrape(sched, h.prefill, h.decode, swa_scheduler(), cores={1: lending_pair()[0]})
    }
    h.close()
    assert names == COVERED


def test_colocated_series(tiny):
    sched = ColocatedScheduler(
        ModelRunner(engine_cfg(kv_pool_tokens=96, page_size=4), tiny[0], tiny[1]),
        sched_cfg(retract_test_interval=4),
        (),
    )
    m0 = scrape(sched)
    assert val(m0, "pdserve_kv_pool_capacity_pages") == 24 and val(m0, "pdserve_kv_pool_pages", state="free") == 24
    assert val(m0, "pdserve_worker_stats_age_seconds") == 2.5 and val(m0, "pdserve_worker_up") == 1
    a, b = prompts(2, 20, seed=1)
    first = run_batch(sched, [a, b], [greedy()] * 2)
    c = a[:16] + [1, 2, 3]
    third = run_batch(sched, [c], [greedy()])
    with pytest.raises(RequestRejected):
        sched.add(b"", GenerateRequest(rid="big", params=greedy(200)), a)
    sched.add(b"", GenerateRequest(rid="cut", params=greedy()), b)
    sched.step()  # its prefill: the prompt's full pages are the radix cache's (insert on prefill)
    sched.step()  # a decode step: the page of its first output token is its own
    mid = scrape(sched)
    assert (
        val(mid, "pdserve_queue_requests", queue="running") == 1 and val(mid, "pdserve_kv_pool_pages", state="used") > 0
    )
    sched.abort("cut")
    m = scrape(sched)
    assert val(m, "pdserve_prompt_tokens_total") == 20 + 20 + 19 + 20
    assert val(m, "pdserve_generation_tokens_total") == 3 * OUT + 2  # cut: its first token and one more
    assert [len(d.token_ids) for d in first + third] == [OUT] * 3
    assert val(m, "pdserve_worker_finished_requests_total") == 3
    assert val(m, "pdserve_worker_aborted_requests_total") == 1
    assert val(m, "pdserve_worker_rejected_requests_total") == 1
    assert val(m, "pdserve_cached_prompt_tokens_total") == 16 + 16  # c's prefix of a, then cut's of b
    n = val(m, "pdserve_retractions_total")
    assert n >= 1 and val(m, "pdserve_retracted_input_tokens_total") == 20 * n  # only a and b run together
    assert n <= val(m, "pdserve_retracted_output_tokens_total") <= (OUT - 1) * n
    assert val(m, "pdserve_oom_aborts_total") == 0
    assert val(m, "pdserve_kv_pool_pages", state="used") == 0 and val(m, "pdserve_kv_pool_pages", state="cached") > 0
    assert sum(val(m, "pdserve_kv_pool_pages", state=s) for s in ("free", "used", "cached")) == 24
    assert 0 < val(m, "pdserve_new_token_ratio") <= 1
    for phase in ("queue", "decode"):
        assert val(m, "pdserve_request_phase_seconds_count", phase=phase) >= 3


def test_oom_abort_series(tiny):
    # the safety net: unreachable through add() (check_fits refuses what can never fit), so the
    # request goes straight into the running batch with a pool too small for its next token
    sched = ColocatedScheduler(
        ModelRunner(engine_cfg(kv_pool_tokens=16, page_size=4), tiny[0], tiny[1]), sched_cfg(), ()
    )
    sched.add(b"", GenerateRequest(rid="r", params=greedy(4)), prompts(1, 12, seed=2)[0])
    while not sched.running:
        sched.step()
    req = next(iter(sched.running))
    req.params = greedy(64)
    req.output_ids += [5] * 4  # pretend it grew: kv_len 15 of 16, the next step needs a 5th page
    req.kv_len = req.seq_len - 1
    assert sched.kv.ensure_pages(req.kv, req.kv_len)
    while sched.has_work:
        sched.step()
    assert val(scrape(sched), "pdserve_oom_aborts_total") == 1


def pd_cfg(pool=4096, host_gb=0.01, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": 4},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": host_gb, "transfer_backend": "loopback"},
        }
    )


def run_pd(tiny, host_gb):
    h = PDHarness(pd_cfg(), pd_cfg(pool=96, host_gb=host_gb, init_new_token_ratio=0.1), tiny[0], tiny[1])
    m0 = scrape(h.prefill, h.decode)
    for i, p in enumerate(prompts(4, 20, seed=21)):
        h.submit(f"r{i}", p, greedy())
    out = h.run()
    assert all(len(o["tokens"]) == OUT for o in out.values())
    m = scrape(h.prefill, h.decode)
    page_bytes = h.p_runner.pool.page_bytes
    h.check_clean()
    h.close()
    return m0, m, page_bytes


def test_pd_series_with_offload(tiny):
    m0, m, page_bytes = run_pd(tiny, host_gb=0.01)
    p, d = {"worker": "w0"}, {"worker": "w1"}
    assert val(m0, "pdserve_host_kv_pool_bytes", state="used", **d) == 0
    assert val(m0, "pdserve_host_kv_pool_bytes", state="free", **d) > 0
    assert val(m, "pdserve_prompt_tokens_total", **p) == val(m, "pdserve_prompt_tokens_total", **d) == 80
    assert val(m, "pdserve_generation_tokens_total", **d) == 4 * OUT
    assert val(m, "pdserve_worker_finished_requests_total", **d) == 4
    assert val(m, "pdserve_kv_transfer_bytes_total", **p) == 4 * 5 * page_bytes  # 20 tokens: 5 pages each
    assert val(m, "pdserve_kv_transfer_seconds_count", **p) == 4
    resumed = val(m, "pdserve_retract_resumed_total", **d)
    assert val(m, "pdserve_retractions_total", **d) == resumed > 0
    offload = val(m, "pdserve_retract_offload_bytes_total", **d)
    assert offload >= resumed * 5 * page_bytes and offload % page_bytes == 0
    assert val(m, "pdserve_retract_offload_seconds_count", **d) == resumed
    assert val(m, "pdserve_retract_resume_seconds_count", **d) == resumed
    assert val(m, "pdserve_retract_recomputed_total", **d) == 0
    assert val(m, "pdserve_host_kv_pool_bytes", state="used", **d) == 0
    assert val(m, "pdserve_transfer_failures_total") == 0
    for q in ("prealloc", "transfer", "running", "retracted"):
        assert ("pdserve_queue_requests", tuple(sorted({"queue": q, **d}.items()))) in m


def test_pd_series_with_recompute(tiny):
    _, m, page_bytes = run_pd(tiny, host_gb=0.0)
    p, d = {"worker": "w0"}, {"worker": "w1"}
    recomputed = val(m, "pdserve_retract_recomputed_total", **d)
    assert recomputed > 0 and val(m, "pdserve_retract_offload_bytes_total", **d) == 0
    assert val(m, "pdserve_retractions_total", **d) == recomputed
    assert val(m, "pdserve_kv_transfer_seconds_count", **p) == 4 + recomputed  # each recompute is re-shipped
    assert val(m, "pdserve_kv_transfer_bytes_total", **p) > 4 * 5 * page_bytes


def test_direct_answers_series(tiny):
    """A one-token request the prefill worker answers itself moves its direct answers by one and
    writes no KV; one through the decode worker moves nothing."""
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    one = SamplingParams(max_new_tokens=1, temperature=0)
    m0 = scrape(h.prefill, h.decode)
    h.answer("a", prompts(1, 12, seed=4)[0], one)
    h.submit("b", prompts(1, 12, seed=5)[0], one)
    h.run()
    m = scrape(h.prefill, h.decode)

    def moved(name: str, worker: str) -> float:
        return val(m, name, worker=worker) - val(m0, name, worker=worker)

    assert moved("pdserve_prefill_direct_answers_total", "w0") == 1
    assert moved("pdserve_worker_finished_requests_total", "w0") == 2
    assert moved("pdserve_prefill_direct_answers_total", "w1") == 0
    assert val(m, "pdserve_kv_transfer_seconds_count", worker="w0") == 1  # "b" alone
    h.check_clean()
    h.close()


def test_transfer_failure_series(tiny, monkeypatch):
    from prefill_worker import scheduler as ps_mod

    real = ps_mod.PrefillScheduler._manifest
    monkeypatch.setattr(
        ps_mod.PrefillScheduler,
        "_manifest",
        lambda self, job, ev: real(self, job, ev).model_copy(update={"n_tokens": job.req.kv_len + 1}),
    )
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    h.submit("x", prompts(1, 10, seed=3)[0], greedy())
    assert h.run()["x"]["finish"] == "abort"
    assert val(scrape(h.prefill, h.decode), "pdserve_transfer_failures_total", worker="w1") == 1
    h.check_clean()
    h.close()


def test_swa_series():
    """SWA pool gauges by state, pages the window freed, and refusals for the SWA pool."""
    sched = swa_scheduler()
    m0 = scrape(sched)
    assert val(m0, "pdserve_swa_pool_capacity_pages") == 16 and val(m0, "pdserve_swa_pool_pages", state="free") == 16
    a = prompts(1, 30, seed=4)[0]  # 8 pages; window 8 at page 4 keeps 4 pages decoding
    sched.add(b"", GenerateRequest(rid="a", params=greedy(10)), a)
    sched.step()  # prefill: all 8 SWA pages, then the window
    mid = scrape(sched)
    used = val(mid, "pdserve_swa_pool_pages", state="used")
    assert 0 < used <= sched.kv.window.max_pages()
    assert val(mid, "pdserve_swa_pages_released_total") == 8 - used
    while sched.has_work:
        sched.step()
    m = scrape(sched)
    released = val(m, "pdserve_swa_pages_released_total")
    cached = val(m, "pdserve_swa_pool_pages", state="cached")
    assert val(m, "pdserve_swa_pool_pages", state="used") == 0
    # 39 tokens of KV: its 9 whole SWA pages were freed by the window or went to the cache (the
    # partial tenth was freed at the end, like a full-pool page)
    assert (released, cached) == (7, 2)
    with pytest.raises(RequestRejected, match="--swa-pool-tokens"):
        sched.add(b"", GenerateRequest(rid="big", params=greedy(2)), prompts(1, 70, seed=5)[0])
    assert val(scrape(sched), "pdserve_swa_rejections_total") == 1
