"""Live migration for balance (``--migrate-on-retract``), in one process: a decode
worker that retracts a running request for lack of pages (its KV copied to the host pool by the
retract) offers it to a peer with room at once, instead of after ``--migrate-after``. With a bound
no request ever reaches (100000 steps) only the flag can move anything: with it requests move,
without it none does; tokens equal transformers' greedy ones (the no-pressure run) either way, and
no device page or host byte is left on either decode worker (also checked at teardown)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from bench.harness.pd_harness import checked_harnesses
from configs.schema import PdserveConfig
from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.migration import MigrationPolicy
from engine.request import Request
from engine.sampling import SamplerState
from tests.support.migration_harness import MigrationHarness
from tests.support.models import hf_greedy
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)
NEVER = "100000"  # decode steps: no parked request waits this long in these runs


def cfg(pool=4096, migrate_after=None, on_retract=False, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": 4},
            "scheduler": sched,
            "cluster": {
                "mode": "pd",
                "host_kv_pool_gb": 0.01,
                "transfer_backend": "loopback",
                "migrate_after": migrate_after,
                "migrate_on_retract": on_retract,
            },
        }
    )


def test_flag_needs_migrate_after():
    with pytest.raises(ValidationError, match="add --migrate-after"):
        cfg(on_retract=True)
    assert cfg(migrate_after="20", on_retract=True).cluster.migrate_on_retract


def test_policy_offers_a_fresh_retract_at_once_and_a_declined_one_after_the_bound():
    req = Request("r", [1, 2, 3], GREEDY, SamplerState.new(GREEDY, 8))
    job = DecodeJob(req, 1, "a", state=DecodeState.HOST_PARKED)
    job.parked_step = 10
    live, plain = MigrationPolicy.from_flag("5", on_retract=True), MigrationPolicy.from_flag("5")
    assert live.due(job, 10, 0.0, fresh=True) and not plain.due(job, 10, 0.0, fresh=True)
    assert not live.due(job, 14, 0.0) and live.due(job, 15, 0.0)  # back from a decline: the bound again


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda d1: MigrationHarness(cfg(), d1, cfg(), tiny[0], tiny[1]))


def _prompts():
    """4 x (20 + 16) tokens into a 24-page pool (tests/decode_worker/test_migration.py's skew: no EOS
    within 16 tokens)."""
    rng = random.Random(21)
    return [[rng.randrange(0, 96) for _ in range(rng.randint(20, 20))] for _ in range(4)]


def _clean(h: MigrationHarness) -> None:
    for w in ("d1", "d2"):
        s = h.workers[w]
        assert s.kv.usage([]).used == 0 and not s.jobs, w
        assert s.retract.host.num_free() == s.retract.host.num_pages and not s.retract.queue, w


@pytest.mark.slow
@pytest.mark.parametrize("on_retract", [True, False])
def test_retracted_running_request_moves_at_once(harness, tiny, on_retract):
    h = harness(cfg(pool=96, migrate_after=NEVER, on_retract=on_retract, init_new_token_ratio=0.1))
    ps = _prompts()
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    out = h.run()
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert all(o["error"] is None and o["finish"] == "length" for o in out.values())
    ms1, ms2 = h.d1.migration_stats, h.d2.migration_stats
    assert h.d1.retract.stats.offloaded > 0  # the pool ran out: running requests were retracted to host
    moved = [r for r, o in out.items() if "d2" in o["from"]]
    if on_retract:
        assert ms1.out_done > 0 and ms2.in_done == ms1.out_done == len(moved)
        assert ms1.out_failed == ms2.in_failed == ms2.in_refused == 0
        assert all(out[r]["from"][0] == "d1" for r in moved)  # one stream, started on d1, ended on d2
    else:
        assert ms1.out_done == 0 and not moved and h.d1.retract.stats.resumed > 0
    _clean(h)
