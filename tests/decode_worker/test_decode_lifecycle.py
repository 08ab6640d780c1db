"""The decode job's state machine (``DecodeState``: every edge checked, illegal ones raise, the
shared ``Phase`` kept in step) and the edges a retract-heavy PD run takes through
``RetractManager`` (offload, resume, recompute)."""

from __future__ import annotations

import itertools
import random

import pytest

from bench.harness.pd_harness import PDHarness
from configs.schema import PdserveConfig
from decode_worker.jobs import PHASE_OF, TRANSITIONS, DecodeJob, DecodeState, IllegalTransition, can_move
from engine.request import Phase, Request
from tests.support.models import hf_greedy
from transfer.wire.enums import FinishReason
from transfer.wire.sampling_params import SamplingParams

S = DecodeState
LIFE = [S.AWAITING_KV, S.RUNNING, S.HOST_PARKED, S.RUNNING, S.RECOMPUTING, S.AWAITING_KV, S.RUNNING, S.FINISHED]


def pd_cfg(pool: int, host_gb: float, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": 4},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": host_gb, "transfer_backend": "loopback"},
        }
    )


def job(state: DecodeState = S.QUEUED) -> DecodeJob:
    req = Request("r", [1, 2, 3], SamplingParams(), sampler_state=None)
    return DecodeJob(req, room=7, prefill_addr="tcp://p", state=state)


def test_a_new_job_is_queued_and_prealloc():
    j = job()
    assert j.state is S.QUEUED and j.req.status is Phase.PREALLOC


def test_the_full_life_keeps_the_phase_in_step():
    j = job()
    for state in LIFE[:-1]:
        j.enter(state)
        assert j.state is state and j.req.status is PHASE_OF[state]
    j.req.finish(FinishReason.STOP)
    j.enter(S.FINISHED)
    assert j.state is S.FINISHED and j.req.status is Phase.FINISHED


@pytest.mark.parametrize(
    "src,dst",
    [
        (S.QUEUED, S.RUNNING),
        (S.QUEUED, S.HOST_PARKED),
        (S.AWAITING_KV, S.HOST_PARKED),
        (S.RUNNING, S.AWAITING_KV),
        (S.HOST_PARKED, S.RECOMPUTING),
        (S.RECOMPUTING, S.RUNNING),
        (S.FINISHED, S.RUNNING),
        (S.FINISHED, S.FINISHED),
        (S.RUNNING, S.RUNNING),
        (S.RUNNING, S.QUEUED),
    ],
)
def test_an_illegal_transition_raises_and_changes_nothing(src, dst):
    j = job(src)
    phase = j.req.status
    with pytest.raises(IllegalTransition, match=f"{src} -> {dst}"):
        j.enter(dst)
    assert j.state is src and j.req.status is phase


def test_every_pair_moves_exactly_when_it_is_an_edge():
    for src, dst in itertools.product(S, S):
        j, legal = job(src), can_move(src, dst)
        assert legal == (dst in TRANSITIONS[src] or (dst is S.FINISHED and src is not S.FINISHED))
        if legal:
            j.enter(dst)
            assert j.state is dst
        else:
            with pytest.raises(IllegalTransition):
                j.enter(dst)
    assert all(can_move(s, S.FINISHED) for s in S if s is not S.FINISHED)
    assert not TRANSITIONS[S.FINISHED] and set(TRANSITIONS) == set(S) == set(PHASE_OF)


def test_a_retract_heavy_pd_run_takes_offload_resume_and_recompute_edges(tiny, monkeypatch):
    edges, enter = set(), DecodeJob.enter

    def record(self, state):
        src = self.state
        enter(self, state)
        edges.add((src, state))

    monkeypatch.setattr(DecodeJob, "enter", record)
    c = tiny[0]
    page_bytes = c.num_layers * 2 * 4 * c.num_kv_heads * c.head_dim * 4  # page 4, fp32
    h = PDHarness(pd_cfg(4096, 0.01), pd_cfg(96, 8 * page_bytes / 2**30, init_new_token_ratio=0.1), tiny[0], tiny[1])
    try:
        rng = random.Random(41)
        ps = [[rng.randrange(0, 96) for _ in range(rng.randint(18, 22))] for _ in range(6)]
        for i, p in enumerate(ps):
            h.submit(f"r{i}", p, SamplingParams(max_new_tokens=16, temperature=0))
        out = h.run()
        assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
        rs = h.decode.retract.stats
        assert rs.offloaded > 0 and rs.recomputed > 0 and rs.resumed == rs.offloaded
        assert {
            (S.QUEUED, S.AWAITING_KV),
            (S.AWAITING_KV, S.RUNNING),
            (S.RUNNING, S.HOST_PARKED),
            (S.HOST_PARKED, S.RUNNING),
            (S.RUNNING, S.RECOMPUTING),
            (S.RECOMPUTING, S.AWAITING_KV),
            (S.RUNNING, S.FINISHED),
        } <= edges
        assert not h.decode.jobs
        h.check_clean()
    finally:
        h.close()
