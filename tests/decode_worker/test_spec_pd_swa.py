"""Speculative decoding in a PD decode worker on a sliding-window hybrid (the tiny window-8 Ministral,
its SWA pool beside the full pool; the in-process PD pair, loopback transport): greedy tokens equal
the plain pair's and transformers', with a retract forced every 3 decode steps offloaded to the host
pool and resumed, and every 4 without a host pool (recomputed by the prefill worker). After every
step both decode pools' invariants hold (free + used + cached == total, no page owned twice), a
running request holds exactly its ``kv_len``'s full pages and SWA entries, resident from its
window's keep start on; drafts are accepted on the decode worker; at the end both pools are clean."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from cache.swa_window import NO_PAGE
from tests.decode_worker.test_spec_pd import drain
from tests.e2e.test_swa_pd import cfg
from tests.engine.test_spec_identity import PLAIN, SPEC, assert_same, greedy
from tests.support.swa import PAGE, hf_reference, swa_prompts

pytestmark = pytest.mark.slow  # PD pairs in one process, each scenario run twice

MAX_NEW = 20


@pytest.fixture
def harness(swa_model):
    def build(spec: bool, **d):
        p = cfg()
        return PDHarness(p, cfg(swa=128, **d, **(SPEC if spec else PLAIN)), swa_model[0], swa_model[1], eos=(96,))

    yield from checked_harnesses(build)


def prompts() -> list[list[int]]:
    """36..40-token prompts that repeat one token or a passage, long enough that the window (8) leaves
    SWA pages behind on both workers; the model answers the first with a run of one token (22), so
    drafts are accepted."""
    head = swa_prompts(1, 8)[0]
    return [[12] * 36, head + [7, 8, 9, 10] * 8, [7] * 40]


def check_swa_rows(dec) -> None:
    """Each running request: as many SWA entries as full pages (a rejected draft position's SWA page
    went back with its full page), every one from its window's keep start on resident, and none of
    its own before it (the pages that left the window after a verify step went back too); ``dec`` a
    decode scheduler."""
    for r in dec.running:
        swa = r.kv.swa
        assert len(swa.pages) == len(r.kv.pages) == dec.kv.pages_for(r.kv_len), (r.rid, len(swa.pages), r.kv_len)
        keep = dec.kv.window.keep_start(r.kv_len) // PAGE
        assert NO_PAGE not in swa.pages[keep:], (r.rid, keep, swa.pages)
        assert set(swa.pages[swa.num_shared : keep]) <= {NO_PAGE}, (r.rid, keep, swa.num_shared, swa.pages)


def run(h: PDHarness) -> dict:
    for i, p in enumerate(prompts()):
        h.submit(f"r{i}", p, greedy(MAX_NEW))
    step = h.step

    def checked_step():
        deltas = step()
        check_swa_rows(h.decode)
        return deltas

    h.step = checked_step
    return drain(h, {})


@pytest.mark.parametrize("host_gb, every", [(0.01, 3), (0.0, 4)])
def test_swa_hybrid_identical_with_forced_retracts(harness, swa_model, host_gb, every):
    plain = run(harness(False, host_gb=host_gb, retract_test_interval=every))
    h = harness(True, host_gb=host_gb, retract_test_interval=every)
    out = run(h)
    assert_same(out, plain)
    assert [out[f"r{i}"][0] for i in range(3)] == [hf_reference(swa_model[2], p, MAX_NEW)[0] for p in prompts()]
    dec = h.decode
    assert dec.spec.accepted_tokens >= 10, (dec.spec.draft_tokens, dec.spec.accepted_tokens)
    assert dec.stats.retractions > 0
    rs = dec.retract.stats
    if host_gb:
        assert rs.offloaded > 0 and rs.resumed == rs.offloaded
    else:
        assert rs.recomputed > 0
    assert dec.kv.swa_pages_released > 0  # the window really dropped pages on the decode worker
    assert dec.kv.usage([], "swa").used == 0 and dec.kv.usage([]).used == 0
