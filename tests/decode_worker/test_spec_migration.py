"""Speculative decoding across a migration between decode workers (1 prefill + 2 decode workers and
the router's migration logic in one process, ``MigrationHarness``): requests that draft on d1 are
retracted there for lack of pages, move to d2 through the host pool, and draft again on d2 from an
n-gram index the new worker builds from prompt + output so far. Their tokens equal those of the
same cluster without speculation, token for token (greedy and seeded); drafts are accepted on d2,
which only ever sees migrated requests; after every step both decode pools' invariants hold and a
running request holds exactly its ``kv_len``'s pages. The same on the window-8 SWA hybrid, whose
running requests also hold exactly their window's SWA pages, with greedy tokens equal transformers'."""

from __future__ import annotations

import random

import pytest

from bench.harness.pd_harness import checked_harnesses
from configs.schema import PdserveConfig
from tests.decode_worker.test_migration import cfg
from tests.decode_worker.test_spec_pd_swa import check_swa_rows
from tests.engine.test_spec_identity import LOOPING, PLAIN, SPEC
from tests.support.migration_harness import MigrationHarness
from tests.support.swa import PAGE, hf_reference
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # two 3-worker clusters in one process

MAX_NEW = 24


@pytest.fixture
def harness(tiny, swa_model):
    def build(spec: bool, swa: bool = False):
        s = SPEC if spec else PLAIN
        if swa:  # the window-8 hybrid: d1's pools of 18 full and 12 SWA pages
            model = swa_model
            d1 = swa_cfg(pool=72, swa=48, migrate_after="1", init_new_token_ratio=0.1, **s)
            return MigrationHarness(swa_cfg(), d1, swa_cfg(**s), model[0], model[1])
        d1 = cfg(pool=112, migrate_after="1", init_new_token_ratio=0.1, **s)
        return MigrationHarness(cfg(), d1, cfg(**s), tiny[0], tiny[1])

    yield from checked_harnesses(build)


def swa_cfg(pool=1024, swa=256, migrate_after=None, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": PAGE, "swa_pool_tokens": swa},
            "scheduler": sched,
            "cluster": {
                "mode": "pd",
                "host_kv_pool_gb": 0.01,
                "transfer_backend": "loopback",
                "migrate_after": migrate_after,
            },
        }
    )


def prompts() -> list[list[int]]:
    """4 prompts of 20 tokens that repeat one token or a short passage (the drafter finds what follows),
    4 x (20 + 24) tokens into d1's 28-page pool: d1 must retract and, with a peer with room, migrate.
    The requests may end at EOS (no ``ignore_eos``): only then does admission overcommit the pool."""
    rng = random.Random(5)
    out = []
    for i in range(4):
        if i % 2 == 0:
            out.append([LOOPING[i // 2]] * 20)
        else:
            passage = [rng.randrange(0, 96) for _ in range(5)]
            out.append(passage * 4)
    return out


def run_checked(h: MigrationHarness, params: list[SamplingParams], ps: list[list[int]] | None = None) -> dict:
    for i, (p, sp) in enumerate(zip(ps or prompts(), params)):
        h.submit(f"r{i}", p, sp, decode="d1")
    for _ in range(5000):
        if not h.busy:
            break
        h.step()
        for w in ("d1", "d2"):
            s = h.workers[w]
            s.check_integrity()
            for r in s.running:  # rejected positions' pages went back, on either side of a move
                assert len(r.kv.pages) == s.kv.pages_for(r.kv_len), (w, r.rid, len(r.kv.pages), r.kv_len)
            if s.kv.has_swa:
                check_swa_rows(s)
    assert not h.busy, "harness did not drain"
    return h.out


def same_across_the_move(harness, params: list[SamplingParams], ps=None, **kw) -> MigrationHarness:
    plain_h = harness(False, **kw)
    plain = run_checked(plain_h, params, ps)
    h = harness(True, **kw)
    sent, adopted = spy_records(h)
    spec = run_checked(h, params, ps)
    got = {r: (o["tokens"], o["finish"], o["error"]) for r, o in spec.items()}
    assert got == {r: (o["tokens"], o["finish"], o["error"]) for r, o in plain.items()}
    assert all(o["error"] is None and o["finish"] in ("length", "stop") for o in spec.values())
    ms1, ms2 = h.d1.migration_stats, h.d2.migration_stats
    assert ms1.out_done > 0 and ms2.in_done == ms1.out_done and ms1.out_failed == ms2.in_refused == 0
    moved = [r for r, o in spec.items() if "d2" in o["from"]]
    assert len(moved) == ms1.out_done and all(spec[r]["from"][0] == "d1" for r in moved)
    assert h.d1.spec.accepted_tokens > 0  # drafted before the move
    # d2 only ever holds migrated requests: its accepted drafts come from the index it built for them
    assert h.d2.spec.accepted_tokens > 0, (h.d2.spec.draft_tokens, h.d2.spec.accepted_tokens)
    assert plain_h.d2.spec is None or plain_h.d2.spec.draft_tokens == 0
    # each moved request's acceptance record and back-off went with it: d2 took over d1's, not its prior
    assert set(adopted) == set(moved) and all(adopted[r] == sent[r] for r in moved), (sent, adopted)
    return h


def spy_records(h: MigrationHarness) -> tuple[dict, dict]:
    """The draft records d1 puts in its offers and those d2 adopts, by request id, as they happen."""
    sent, adopted = {}, {}
    record, adopt = h.d1.spec.record, h.d2.spec.adopt

    def recorded(req):
        sent[req.rid] = out = record(req)
        return out

    def adopting(req, rec):
        adopted[req.rid] = rec
        adopt(req, rec)

    h.d1.spec.record, h.d2.spec.adopt = recorded, adopting
    return sent, adopted


def test_greedy_requests_draft_again_after_the_move(harness):
    h = same_across_the_move(harness, [SamplingParams(max_new_tokens=MAX_NEW, temperature=0)] * 4)
    assert all(len(o["tokens"]) == MAX_NEW for o in h.out.values())  # no EOS: every request ran long enough to move


def test_seeded_and_penalised_requests_draft_again_after_the_move(harness):
    """The sampler state (seeded generator per output index, penalty counts) is rebuilt on d2 from the
    output so far, as is the n-gram index: the accepted drafts there are the tokens the plain run samples."""
    params = [
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.3, seed=7),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0, frequency_penalty=0.3),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.5, top_k=5, seed=11),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0),
    ]
    same_across_the_move(harness, params)


def test_swa_hybrid_requests_draft_again_after_the_move(harness, swa_model):
    """The window-8 hybrid: the host copy carries the full pages and the SWA window, the target's
    verify steps take and give back SWA pages; greedy tokens equal the plain cluster's and
    transformers', and after every step each running request's SWA pages are those of its window."""
    ps = [[12] * 30, [7, 8, 9, 10] * 8, [7] * 30, [12] * 28]
    h = same_across_the_move(harness, [SamplingParams(max_new_tokens=20, temperature=0)] * 4, ps, swa=True)
    assert [h.out[f"r{i}"]["tokens"] for i in range(4)] == [hf_reference(swa_model[2], p, 20)[0] for p in ps]
    assert h.d2.kv.swa_pages_released > 0
