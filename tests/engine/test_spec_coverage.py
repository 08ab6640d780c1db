"""``NgramSpeculator.coverage`` counts each row-step ``drafts`` decides once, by why it carries a draft or
not: drafted, backed off, no n-gram match, at its token limit, a draft dropped by the cost rule / cap, or a
step full without drafts."""

from __future__ import annotations

import dataclasses

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from engine.spec.pays import Acceptance
from engine.spec.verify import Coverage, NgramSpeculator
from tests.engine.test_spec_pays import running


def test_each_row_step_is_counted_once_by_its_reason():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=4, n_min=1, n_max=3, max_model_len=10**6, fixed=12.0)
    reqs = [running(kv, f"r{i}") for i in range(8)]
    reqs[2] = running(kv, "new", [5, 6, 7, 3])  # its last token (1) never occurred before: no match
    spec._drafting(reqs[1]).wait = 5  # backs off
    spec._drafting(reqs[3]).acceptance = Acceptance(hits=0.0, misses=3.0)  # a match the cost rule drops
    reqs[4].params = reqs[4].params.model_copy(update=dict(max_new_tokens=1))  # one token left: no room
    lengths = [len(d) for d in spec.drafts(reqs, 0)]
    assert [n > 0 for n in lengths] == [True, False, False, False, False, True, True, True], lengths
    assert spec.coverage == Coverage(drafted=4, backed_off=1, no_match=1, at_limit=1, dropped=1)
    spec.step_tokens = 8  # eight rows fill the step: nothing looked up
    assert not any(spec.drafts(reqs, 0))
    assert dataclasses.asdict(spec.coverage) | {"full": 0} == dataclasses.asdict(
        Coverage(drafted=4, backed_off=1, no_match=1, at_limit=1, dropped=1)
    )
    assert spec.coverage.full == 8
