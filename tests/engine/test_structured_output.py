"""Structured output in the engine (the embedded model): llguidance masks applied in the batched
sampler keep greedy and sampled outputs inside a JSON schema, a regex and a choice, in one batch
with unconstrained requests (whose greedy tokens stay those of an unconstrained run); a forced
retract keeps the grammar state (and the seeded tokens); an invalid constraint is refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.llm import LLM
from engine.scheduler.base import RequestRejected
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.slow  # the embedded model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON with a name and an age:"


@pytest.fixture(scope="module")
def llm(embedded):
    cfg, weights, tok, _ = embedded
    return LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(cfg, weights, tok))


def constrained(kind: str, spec, **kw) -> SamplingParams:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return SamplingParams(max_new_tokens=48, structured=StructuredOutput(kind=kind, spec=text), **kw)


def test_json_regex_choice_in_one_batch_with_a_free_row(llm):
    free = SamplingParams(max_new_tokens=12, temperature=0)
    params = [
        constrained("json", SCHEMA, temperature=0),
        *(constrained("json", SCHEMA, temperature=1.0, seed=s) for s in range(4)),
        constrained("regex", r"[0-9]{3}-[a-z]{2}", temperature=1.0, seed=1),
        constrained("choice", ["red", "green", "blue"], temperature=0),
        free,
    ]
    prompts = [llm.encode_prompt(PROMPT)] * (len(params) - 1) + [llm.encode_prompt("The capital of France is")]
    out = llm.generate_ids(prompts, params)
    for r in out[:5]:
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.finish_reason == "stop", r.text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out[5].text), out[5].text
    assert out[6].text in ("red", "green", "blue")
    assert out[7].token_ids == llm.generate_ids(prompts[-1:], [free])[0].token_ids  # masks touch only their rows


def test_forced_retract_keeps_the_grammar_state(embedded, llm):
    cfg, weights, tok, _ = embedded
    retracting = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(retract_test_interval=3), loaded=(cfg, weights, tok))
    params = [constrained("json", SCHEMA, temperature=1.0, seed=s) for s in (11, 12, 13)]
    prompts = [llm.encode_prompt(PROMPT)] * 3
    out = retracting.generate_ids(prompts, params)
    assert retracting.scheduler.stats.retractions > 0
    for r in out:
        jsonschema.validate(json.loads(r.text), SCHEMA)
    assert [r.token_ids for r in out] == [r.token_ids for r in llm.generate_ids(prompts, params)]


def test_invalid_constraint_is_refused(llm):
    with pytest.raises(RequestRejected, match="regex"):
        llm.scheduler.add(b"", GenerateRequest(rid="bad", params=constrained("regex", "(")), [1, 2, 3])
