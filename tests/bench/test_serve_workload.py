"""``pdserve bench serve``'s workload: prompt lengths in the model's tokens, the shared prefix,
determinism in the seed, Poisson arrivals at the asked rate, refused shapes, the interference
mix. Statistics, the client and a real run: tests/bench/test_serve_bench.py."""

from __future__ import annotations

import math

import pytest

from bench.serve.interference import InterferenceSpec, interference_requests
from bench.serve.workload import PromptShape, TokenCounter, WordCounter, make_requests, poisson_arrivals


# ---- workload ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def token_counter(tokenizer):
    return TokenCounter(tokenizer)


def test_prompt_lengths_in_tokens_of_the_model(token_counter):
    reqs = make_requests(PromptShape(40, 20, 300, 8), token_counter, seed=1)
    assert all(20 <= r.prompt_len <= 300 for r in reqs)
    assert all(r.prompt_len == len(token_counter.tok.encode(r.prompt)) for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10  # a distribution, not one length
    assert len({r.prompt for r in reqs}) == 40 and all(r.output_len == 8 for r in reqs)
    exact = make_requests(PromptShape(5, 77, 77, 8), token_counter, seed=2)
    assert [r.prompt_len for r in exact] == [77] * 5


def test_shared_prefix_is_shared_in_tokens(token_counter):
    reqs = make_requests(PromptShape(12, 100, 160, 8, shared_prefix_len=64), token_counter, seed=3)
    ids = [token_counter.tok.encode(r.prompt) for r in reqs]
    assert all(i[:64] == ids[0][:64] for i in ids)
    assert len({tuple(i[:72]) for i in ids}) == 12  # and then they differ
    assert (
        len(
            {
                tuple(i[:64])
                for i in (
                    token_counter.tok.encode(r.prompt)
                    for r in make_requests(PromptShape(12, 100, 160, 8), token_counter, seed=3)
                )
            }
        )
        == 12
    )


def test_workload_is_deterministic_in_its_seed():
    shape = PromptShape(20, 5, 50, 4, shared_prefix_len=3)
    a, b = make_requests(shape, WordCounter(), 7), make_requests(shape, WordCounter(), 7)
    assert a == b and make_requests(shape, WordCounter(), 8) != a
    assert [r.prompt_len for r in a] == [len(r.prompt.split()) for r in a]
    assert poisson_arrivals(a, 2.0, 1) == poisson_arrivals(b, 2.0, 1) != poisson_arrivals(a, 2.0, 2)


def test_poisson_arrivals_have_the_asked_rate():
    reqs = make_requests(PromptShape(4000, 1, 1, 1), WordCounter(), 0)
    times = [r.arrival_s for r in poisson_arrivals(reqs, 4.0, seed=5)]
    assert times[0] == 0 and all(b >= a for a, b in zip(times, times[1:]))
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.06)
    assert {r.arrival_s for r in poisson_arrivals(reqs[:5], math.inf, 0)} == {0.0}
    with pytest.raises(ValueError):
        poisson_arrivals(reqs, 0, 0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="shared prefix"):
        PromptShape(1, 10, 20, 4, shared_prefix_len=10)
    with pytest.raises(ValueError):
        PromptShape(1, 30, 20, 4)


def test_interference_mix(token_counter):
    spec = InterferenceSpec(PromptShape(30, 32, 96, 16, kind="short"), 2.0, PromptShape(4, 1500, 2000, 8, kind="long"))
    reqs = interference_requests(spec, token_counter, seed=0)
    assert [r.index for r in reqs] == list(range(34))
    assert sorted(r.arrival_s for r in reqs) == [r.arrival_s for r in reqs]
    longs = [r for r in reqs if r.kind == "long"]
    assert len(longs) == 4 and all(1500 <= r.prompt_len <= 2000 and r.output_len == 8 for r in longs)
    assert all(32 <= r.prompt_len <= 96 for r in reqs if r.kind == "short")
    assert longs[0].arrival_s > 0 and reqs[0].kind == "short"  # long ones land among the short stream
    assert spec.effective_long_rate() == pytest.approx(4 / 15)
    assert interference_requests(spec, token_counter, seed=0) == reqs
