"""Per-request phase timeline and the event-driven waits: every phase histogram moves by exactly
one per finished request, in process and through a launched PD server's /metrics; schedulers
with nothing to compute tell the loop how long it may block."""

from __future__ import annotations

import httpx
import pytest

from bench.harness.pd_harness import PDHarness
from bench.harness.subprocess_server import metric_sum, wait_idle
from configs.schema import PdserveConfig
from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from engine.scheduler.step_report import StepReport
from engine.scheduler.timeline import LOCAL_PREFILL_PHASES, PHASES
from tests.support.models import engine_cfg, sched_cfg
from tests.support.servers import PD_SERVER_HEARTBEAT_S
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def pd_cfg() -> PdserveConfig:
    return PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 1024, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )


def counts(scheduler) -> dict[str, int]:
    return {
        k.removeprefix("phase_"): h.count for k, h in scheduler.snapshot().histograms.items() if k.startswith("phase_")
    }


def test_colocated_phases_once_per_request(tiny):
    sched = ColocatedScheduler(ModelRunner(engine_cfg(page_size=4), tiny[0], tiny[1]), sched_cfg(), (96,))
    run_batch(sched, [[1, 2, 3, 4, 5], [6, 7, 8]], [GREEDY, GREEDY])
    assert counts(sched) == {name: 2 for name, _, _ in PHASES["colocated"]}


def test_pd_phases_once_per_request_on_each_side(tiny):
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    try:
        h.submit("a", [1, 2, 3, 4, 5, 6, 7], GREEDY)
        assert h.run()["a"]["finish"] == "length"
        assert counts(h.prefill) == {name: 1 for name, _, _ in PHASES["prefill"]}
        assert counts(h.decode) == {name: int(name not in LOCAL_PREFILL_PHASES) for name, _, _ in PHASES["decode"]}
    finally:
        h.close()


def test_schedulers_with_nothing_to_compute_let_the_loop_block(tiny):
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    try:
        assert h.decode.idle_wait_s() is None and h.prefill.idle_wait_s() is None  # nothing at all
        h.submit("a", [1, 2, 3, 4, 5], GREEDY)
        h.prefill.step = lambda: StepReport()  # the prefill worker is slow: the KV does not come yet
        h.step()
        assert h.decode.transfers.inflight and not h.decode.has_work  # waiting, not computing
        # no write announced yet (KVWriteStarted): no transport polling, the peers' deadlines only
        assert h.decode.idle_wait_s() > 100 * h.decode.transfers.transport.poll_interval_s
        wait = h.prefill.idle_wait_s()  # a queued prompt waits on its bootstrap deadline
        assert 0 < wait <= h.prefill.cfg.cluster.bootstrap_timeout_s
    finally:
        del h.prefill.step
        h.run()
        h.close()


@pytest.mark.process
def test_phase_metrics_through_a_pd_server(pd_server):
    url = pd_server.url
    before = wait_idle(url, PD_SERVER_HEARTBEAT_S)
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    m = wait_idle(url, PD_SERVER_HEARTBEAT_S)
    name = "pdserve_request_phase_seconds_count"
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        for phase in (p for p, _, _ in PHASES[role] if p not in LOCAL_PREFILL_PHASES):  # --local-prefill-max-tokens 0
            moved = metric_sum(m, name, worker=worker, phase=phase) - metric_sum(
                before, name, worker=worker, phase=phase
            )
            assert moved == 1, (worker, phase)
    q = "pdserve_router_queue_seconds_count"
    assert metric_sum(m, q) - metric_sum(before, q) == 1
