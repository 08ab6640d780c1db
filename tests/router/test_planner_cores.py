"""The planner's model of the host's compute: where the workers share one host's cores (lending
them to whichever is busy) a move adds no compute, so a TTFT or TPOT violation moves nothing;
where each worker has its own cores (nodes) the same violation moves a worker. The decode-bound
rule (decode pages, not compute) moves a worker either way. ``auto`` resolves from the launch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from configs.schema import PdserveConfig
from server.launch.worker_cores import with_planner_cores
from server.router.planner import ClusterView, Knobs, PlannerState, WorkerView, decide
from server.router.planner_task import knobs_of
from transfer.wire.enums import Role

pytestmark = pytest.mark.unit

OWN = Knobs(slo_ttft_s=1.0, slo_tpot_s=0.1, hysteresis=2, dwell_s=30.0, headroom=0.8)
SHARED = replace(OWN, shared_cores=True)


def pf(wid: str, backlog: float) -> WorkerView:
    return WorkerView(wid, Role.PREFILL, backlog_tokens=backlog, prefill_tps=1000.0)


def dec(wid: str, batch: float, step_s: float, page_waiting: float = 0.0) -> WorkerView:
    return WorkerView(wid, Role.DECODE, batch=batch, step_s=step_s, awaiting=page_waiting, page_waiting=page_waiting)


# TTFT 4.5 s > 1 s with TPOT 0.02 s; TPOT 0.5 s > 0.1 s with TTFT 0.1 s
PREFILL_BOUND = (pf("prefill-0", 4000), dec("decode-0", 2, 0.02), dec("decode-1", 1, 0.02))
DECODE_BOUND = (pf("prefill-0", 0), pf("prefill-1", 0), dec("decode-0", 10, 0.5))


def moves(workers: tuple[WorkerView, ...], knobs: Knobs, times: int = 4):
    state, out = PlannerState(), []
    for i in range(times):
        d = decide(ClusterView(now=100.0 + i, workers=workers, prompt_tokens=500.0), state, knobs)
        state = d.state
        out.append(d)
    return out


@pytest.mark.parametrize("workers", [PREFILL_BOUND, DECODE_BOUND], ids=["ttft", "tpot"])
def test_shared_cores_predict_no_gain_and_hold(workers):
    shared = moves(workers, SHARED)
    assert all(d.move is None for d in shared)
    assert "share the host's cores: a move adds no compute" in shared[-1].why
    assert any(d.move is not None for d in moves(workers, OWN))  # nodes: the violation moves a worker


def test_the_decode_bound_rule_moves_a_worker_on_shared_cores_too():
    """A decode pool full of running requests (6 wait for pages): the move adds pages, not compute."""
    workers = (pf("prefill-0", 4000), pf("prefill-1", 0), dec("decode-0", 40, 0.05, page_waiting=6))
    # either leaves the same backlog to the rest (a leaving worker hands its queued prompts back): the idle
    # one goes, whose switch waits for no prompt
    assert moves(workers, SHARED)[1].move == ("prefill-1", Role.PREFILL, Role.DECODE)


def test_planner_cores_auto_resolves_from_the_launch_and_reaches_the_knobs():
    cfg = PdserveConfig.model_validate({"cluster": {"mode": "pd"}, "server": {"slo_ttft_ms": 1, "slo_tpot_ms": 1}})
    assert cfg.server.planner_cores == "auto" and not knobs_of(cfg.server).shared_cores  # nothing resolved it
    assert knobs_of(with_planner_cores(cfg, shared=True).server).shared_cores
    assert not knobs_of(with_planner_cores(cfg, shared=False).server).shared_cores
    own = cfg.model_copy(update={"server": cfg.server.model_copy(update={"planner_cores": "own"})})
    assert not knobs_of(with_planner_cores(own, shared=True).server).shared_cores  # an explicit choice stays
