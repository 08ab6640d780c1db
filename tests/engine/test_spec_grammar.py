"""Structured-output rows draft too: each drafted position is drawn under the mask of the matcher
advanced over the tokens accepted before it, a rejected draft token is never consumed, and a
draft is cut to the prefix the grammar allows. Outputs (greedy and seeded) equal decoding without
speculation, valid JSON, with drafts accepted inside the constrained output."""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from tests.engine.test_spec_identity import PLAIN, SPEC
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow  # the embedded model (a real tokenizer for the grammar)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
RECORD = '{"name": "Margaret Hamilton", "city": "Cambridge Massachusetts", "age": 88}'


def generate(embedded, spec: bool, params: list[SamplingParams]):
    cfg, weights, tok, _ = embedded
    llm = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(**(SPEC if spec else PLAIN)), loaded=(cfg, weights, tok))
    prompt = llm.encode_prompt(f"Copy this JSON record exactly, as JSON:\n{RECORD}")
    outs = llm.generate_ids([prompt] * len(params), params)
    sched = llm.scheduler
    sched.check_integrity()
    assert sched.kv.usage([]).used == 0
    return outs, sched


def test_json_schema_rows_draft_with_outputs_unchanged(embedded):
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    params = [
        SamplingParams(max_new_tokens=40, temperature=0, structured=so, logprobs=1),
        SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, structured=so),
    ]
    plain, _ = generate(embedded, False, params)
    spec, sched = generate(embedded, True, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert spec[0].logprobs == pytest.approx(plain[0].logprobs, abs=1e-4)
    for o in spec:
        json.loads(o.text)
    # the keys and punctuation recur in the prompt's record: drafts from it are accepted
    assert sched.spec.accepted_tokens >= 5, (sched.spec.draft_tokens, sched.spec.accepted_tokens)


def test_a_draft_is_cut_where_the_grammar_stops_allowing_it(embedded):
    """``Matcher.valid_prefix``: the tokens the grammar allows in turn, the matcher unchanged."""
    cfg, weights, tok, _ = embedded
    llm = LLM(engine_cfg(kv_pool_tokens=1024), sched_cfg(), loaded=(cfg, weights, tok))
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    state = llm.runner.sampler_state(SamplingParams(max_new_tokens=8, structured=so), [1])
    good = tok.encode('{"name": "A', add_special_tokens=False)
    bad = tok.encode('{"nope', add_special_tokens=False)
    m = state.matcher
    assert m.valid_prefix(good) == len(good)
    assert 0 < m.valid_prefix(bad) < len(bad)
    before = m.bitmask()
    m.valid_prefix(good + bad)
    assert m.bitmask() == before  # nothing consumed


def test_json_schema_rows_draft_on_a_pd_decode_worker(embedded):
    """The same requests through the in-process PD pair, speculation on the decode worker only (its
    matcher rebuilt from the prefill worker's first token): the tokens of colocated decoding without
    speculation, drafts accepted on the decode worker, both pools clean."""
    from bench.harness.pd_harness import PDHarness
    from tests.support.pd import pd_cfg

    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    params = [
        SamplingParams(max_new_tokens=40, temperature=0, structured=so),
        SamplingParams(max_new_tokens=40, temperature=0.8, seed=5, structured=so),
    ]
    plain, sched = generate(embedded, False, params)
    cfg, weights, tok, path = embedded
    prompt = LLM(engine_cfg(kv_pool_tokens=256), sched_cfg(), loaded=(cfg, weights, tok)).encode_prompt(
        f"Copy this JSON record exactly, as JSON:\n{RECORD}"
    )
    cfgs = [pd_cfg(pool=1024, page=16, **(SPEC if spec else PLAIN)) for spec in (False, True)]
    for c in cfgs:
        c.engine.model = str(path)
    h = PDHarness(cfgs[0], cfgs[1], cfg, weights, eos=tuple(sched.executor.eos))
    try:
        for i, p in enumerate(params):
            h.submit(f"g{i}", prompt, p)
        out = h.run()
        assert [out[f"g{i}"]["tokens"] for i in range(len(params))] == [o.token_ids for o in plain]
        assert h.decode.spec.accepted_tokens >= 5, (h.decode.spec.draft_tokens, h.decode.spec.accepted_tokens)
        h.check_clean()
    finally:
        h.close()
