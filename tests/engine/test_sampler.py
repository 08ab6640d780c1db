"""Tests for engine.sampling's pipeline: greedy, seeds, the filters' statistics, logit bias, penalties,
logprobs. (SamplingParams validation and check_stop: tests/transfer/test_sampling_params.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import SampleOutput, Sampler, SamplerState, row_argmax, token_seed
from transfer.wire.sampling_params import SamplingParams

# --------------------------------------------------------------------------- helpers

PROBS4 = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS4 = PROBS4.log()


def _states(params, vocab, prompt=()):
    return [SamplerState.new(p, vocab, prompt) for p in params]


def _sample(logits, params, prompt=()):
    return Sampler().sample(logits, params, _states(params, logits.shape[1], prompt))


def _frequencies(params: SamplingParams, logits_row: torch.Tensor, n: int = 5000, seed: int = 0):
    """Draw ``n`` tokens from one row (batched ``n`` times) under a fixed global seed."""
    params_list = [params] * n
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = _sample(logits, params_list)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())
    return counts.float() / n


# --------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_any_dtype():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    expected = logits.argmax(-1).tolist()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        lg = logits.to(dtype)
        out = _sample(lg, [SamplingParams(temperature=0)] * 6)
        assert out.token_ids == lg.argmax(-1).tolist()
    assert _sample(logits, [SamplingParams(temperature=0)] * 6).token_ids == expected


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(2)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.5, seed=i) for i in range(8)]
    before = logits.clone()
    out = _sample(logits, params)
    am = logits.argmax(-1).tolist()
    for i in range(0, 8, 2):
        assert out.token_ids[i] == am[i]
    assert all(0 <= t < 100 for t in out.token_ids)
    assert torch.equal(logits, before)  # input untouched
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


# --------------------------------------------------------------------------- seeds


def test_same_seed_same_sequence():
    torch.manual_seed(3)
    steps = [torch.randn(1, 64) for _ in range(20)]
    p = SamplingParams(seed=1234, temperature=1.0)

    def run():
        st = SamplerState.new(p, 64)
        toks = []
        for lg in steps:
            t = Sampler().sample(lg, [p], [st]).token_ids[0]
            st.append(t)
            toks.append(t)
        return toks

    a, b = run(), run()
    assert a == b
    assert len(set(a)) > 1  # actually random, not collapsed


def test_seeded_request_independent_of_batch():
    torch.manual_seed(4)
    V = 64
    row_steps = [torch.randn(V) for _ in range(10)]
    p = SamplingParams(seed=77, top_k=20, top_p=0.9)

    st_alone = SamplerState.new(p, V)
    alone = []
    for lg in row_steps:
        t = Sampler().sample(lg.unsqueeze(0), [p], [st_alone]).token_ids[0]
        st_alone.append(t)
        alone.append(t)

    others = [SamplingParams(), SamplingParams(seed=5, temperature=0.7), SamplingParams(temperature=0)]
    st = SamplerState.new(p, V)
    st_others = [SamplerState.new(o, V) for o in others]
    batched = []
    for lg in row_steps:
        logits = torch.stack([torch.randn(V), lg, torch.randn(V), torch.randn(V)])
        out = Sampler().sample(
            logits, [others[0], p, others[1], others[2]], [st_others[0], st, st_others[1], st_others[2]]
        )
        st.append(out.token_ids[1])
        batched.append(out.token_ids[1])
    assert alone == batched


# --------------------------------------------------------------------------- statistics


def test_temperature_one_matches_distribution():
    freq = _frequencies(SamplingParams(temperature=1.0), LOGITS4)
    assert torch.allclose(freq, PROBS4, atol=0.02), freq


def test_temperature_half_sharpens():
    freq = _frequencies(SamplingParams(temperature=0.5), LOGITS4)
    expected = torch.softmax(LOGITS4 / 0.5, dim=-1)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)
    assert freq[3] > PROBS4[3] + 0.1  # mass moved to the top token


def test_top_k_two_only_top_two():
    freq = _frequencies(SamplingParams(top_k=2), LOGITS4)
    assert freq[0] == 0 and freq[1] == 0
    expected = torch.tensor([0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7])
    assert torch.allclose(freq, expected, atol=0.02), freq


def test_top_p_smallest_set_reaching_p():
    # sorted probs 0.4, 0.3, 0.2, 0.1: {0.4} < 0.6, {0.4, 0.3} = 0.7 >= 0.6 -> keep tokens 3, 2.
    freq = _frequencies(SamplingParams(top_p=0.6), LOGITS4)
    assert freq[0] == 0 and freq[1] == 0
    assert torch.allclose(freq, torch.tensor([0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7]), atol=0.02), freq
    # a top token that alone reaches top_p is the whole set
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    freq = _frequencies(SamplingParams(top_p=0.45), probs.log(), n=500)
    assert freq[3] == 1.0


def test_min_p_removes_low_tokens():
    # max prob 0.4, min_p 0.6 -> threshold 0.24: tokens 0 (0.1) and 1 (0.2) removed.
    freq = _frequencies(SamplingParams(min_p=0.6), LOGITS4)
    assert freq[0] == 0 and freq[1] == 0
    assert torch.allclose(freq, torch.tensor([0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7]), atol=0.02), freq
    # min_p 0.4 -> threshold 0.16 keeps token 1 but not token 0
    freq = _frequencies(SamplingParams(min_p=0.4), LOGITS4)
    assert freq[0] == 0 and freq[1] > 0.15


def test_heterogeneous_filters_in_one_batch():
    # rows with different top-k / top-p / min-p settings are filtered independently
    probs = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4])
    logits = probs.log().unsqueeze(0).expand(4, -1).contiguous()
    params = [SamplingParams(top_k=1), SamplingParams(top_k=3), SamplingParams(top_p=0.6), SamplingParams(min_p=0.5)]
    allowed = [{4}, {2, 3, 4}, {3, 4}, {3, 4}]
    seen = [set() for _ in params]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for _ in range(300):
            out = _sample(logits, params)
            for i, t in enumerate(out.token_ids):
                seen[i].add(t)
    assert seen == allowed
    # all rows with a top-k (topk fast path) but different k
    params = [SamplingParams(top_k=1), SamplingParams(top_k=2, top_p=0.5)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(12)
        toks = {t for _ in range(200) for t in _sample(logits[:2], params).token_ids}
    assert toks == {4}  # top_k=2 then top_p=0.5 of renormalised {0.57, 0.43} keeps only 4


def test_sampling_with_seeded_generator_distribution():
    # a single seeded request's successive tokens (one draw per output index) follow the distribution
    p = SamplingParams(seed=9)
    st = SamplerState.new(p, 4)
    logits = LOGITS4.unsqueeze(0)
    sampler = Sampler()
    toks = []
    for _ in range(2000):
        toks.append(sampler.sample(logits, [p], [st]).token_ids[0])
        st.append(toks[-1])
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / 2000
    assert torch.allclose(freq, PROBS4, atol=0.035), freq


def test_seeded_draw_is_a_function_of_seed_and_index_only():
    # a fresh state fast-forwarded to index k draws what the original drew at k (PD: the decode
    # worker's new state after the prefill worker drew token 0; colocated: the same state)
    p = SamplingParams(seed=21, temperature=1.0)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    sampler, st, toks = Sampler(), SamplerState.new(p, 64), []
    for _ in range(12):
        toks.append(sampler.sample(logits, [p], [st]).token_ids[0])
        st.append(toks[-1])
    for k in (1, 5, 11):
        fresh = SamplerState.new(p, 64)
        for t in toks[:k]:
            fresh.append(t)
        torch.manual_seed(k)  # the global RNG plays no part
        assert sampler.sample(logits, [p], [fresh]).token_ids[0] == toks[k]
    assert len(set(toks)) > 3  # successive indices draw different noise


def test_token_seed_spreads_and_fits_63_bits():
    seeds = {token_seed(s, i) for s in range(20) for i in range(50)}
    assert len(seeds) == 1000 and all(0 <= x < 2**63 for x in seeds)


# --------------------------------------------------------------------------- logit bias


def test_logit_bias_changes_greedy_choice_but_not_logprobs():
    logits = LOGITS4.unsqueeze(0)  # argmax is token 3
    plain = Sampler().sample(
        logits, [SamplingParams(temperature=0, logprobs=1)], [SamplerState.new(SamplingParams(), 4)]
    )
    p = SamplingParams(temperature=0, logprobs=1, logit_bias={"3": -100, 0: 100})
    out = Sampler().sample(logits, [p], [SamplerState.new(p, 4)])
    assert plain.token_ids == [3] and out.token_ids == [0]
    assert out.top_logprobs[0][0][0] == 3  # logprobs come from the raw distribution
    assert p.logit_bias == ((0, 100.0), (3, -100.0))


def test_logit_bias_ban_holds_under_sampling():
    p = SamplingParams(seed=3, logit_bias={3: -100, 2: -100})
    st, s = SamplerState.new(p, 4), Sampler()
    toks = []
    for _ in range(300):
        toks.append(s.sample(LOGITS4.unsqueeze(0), [p], [st]).token_ids[0])
        st.append(toks[-1])
    assert set(toks) == {0, 1}


def test_logit_bias_outside_the_vocabulary_is_refused():
    p = SamplingParams(temperature=0, logit_bias={9: 1.0})
    with pytest.raises(ValueError, match="vocabulary of 4"):
        Sampler().sample(LOGITS4.unsqueeze(0), [p], [SamplerState.new(p, 4)])


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0, logprobs=0)
    st = SamplerState.new(p, 5, prompt_ids=[0, 1])
    st.append(2)
    # seen {0, 1, 2}: 2.0 -> 1.0, -2.0 -> -4.0, 1.0 -> 0.5; unseen keep -1.0, 0.5
    processed = torch.tensor([[1.0, -4.0, 0.5, -1.0, 0.5]])
    x = logits.clone()
    Sampler._apply_penalties(x, [0], [p], [st])
    assert torch.equal(x, processed)
    # greedy on processed logits: tie between 2 and 4 at 0.5 -> argmax picks first (2)
    out = Sampler().sample(logits, [p], [st])
    assert out.token_ids[0] == processed.argmax(-1).item()
    # a large penalty pushes the previously top token 0 (2.0 -> 0.4) below token 2 (1.0)
    p3 = SamplingParams(temperature=0, repetition_penalty=5.0)
    st3 = SamplerState.new(p3, 5, prompt_ids=[0])
    assert Sampler().sample(logits, [p3], [st3]).token_ids == [2]
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]]))


def test_frequency_presence_penalty_exact():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    st = SamplerState.new(p, 4, prompt_ids=[3, 3, 3])  # prompt does not count
    for t in (0, 0, 0, 1):
        st.append(t)
    x = logits.clone()
    Sampler._apply_penalties(x, [0], [p], [st])
    # token0: 1 - 0.5*3 - 0.25 = -0.75; token1: 1 - 0.5 - 0.25 = 0.25; others untouched
    assert torch.allclose(x, torch.tensor([[-0.75, 0.25, 1.0, 1.0]]))
    assert st.num_generated == 4


def test_penalties_only_affect_their_rows_in_batch():
    torch.manual_seed(6)
    logits = torch.randn(3, 10)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=2.0),
        SamplingParams(temperature=0, repetition_penalty=1e3),
    ]
    am = logits.argmax(-1).tolist()
    states = [SamplerState.new(p, 10, prompt_ids=[am[2]]) for p in params]
    for _ in range(3):
        states[1].append(am[1])
    out = Sampler().sample(logits, params, states)
    assert out.token_ids[0] == am[0]
    assert out.token_ids[1] != am[1]
    assert out.token_ids[2] != am[2]


# --------------------------------------------------------------------------- logprobs


def test_logprobs_chosen_and_top_n():
    torch.manual_seed(7)
    logits = torch.randn(3, 40, dtype=torch.bfloat16)
    params = [
        SamplingParams(logprobs=5, seed=1, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.8),
    ]
    states = [SamplerState.new(p, 40, prompt_ids=[1, 2, 3]) for p in params]
    out = Sampler().sample(logits, params, states)
    assert isinstance(out, SampleOutput)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i in (0, 1):
        assert math.isclose(out.logprobs[i], raw[i, out.token_ids[i]].item(), abs_tol=1e-6)
    top = out.top_logprobs[0]
    assert len(top) == 5
    vals = [v for _, v in top]
    assert vals == sorted(vals, reverse=True)
    ref_vals, ref_ids = raw[0].topk(5)
    assert [t for t, _ in top] == ref_ids.tolist()
    assert torch.allclose(torch.tensor(vals), ref_vals)
    assert out.top_logprobs[1] == []
    assert out.logprobs[2] is None and out.top_logprobs[2] is None


def test_greedy_fast_path_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    out = _sample(logits, [SamplingParams(temperature=0, logprobs=2)])
    raw = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [1]
    assert math.isclose(out.logprobs[0], raw[1].item(), abs_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2]


# --------------------------------------------------------------------------- misc


def test_shape_and_state_errors():
    p = SamplingParams()
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 4), [p], [SamplerState.new(p, 4)])
    with pytest.raises(ValueError):
        SamplerState.new(SamplingParams(repetition_penalty=1.2), 4, prompt_ids=[4])
    st = SamplerState.new(p, 4)
    with pytest.raises(ValueError):
        st.append(4)
    assert Sampler().sample(torch.zeros(0, 4), [], []).token_ids == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_on_ties_nan_and_inf(dtype):
    """``row_argmax`` (``max(-1)`` on CPU, for speed) picks exactly what ``argmax`` picks: the
    first of tied maxima, a NaN over any number, the first index of an all ``-inf`` row."""
    g = torch.Generator().manual_seed(0)
    ties = torch.randint(-3, 4, (16, 4099), generator=g).to(dtype)
    nan = torch.randn(4, 4099, generator=g).to(dtype)
    nan[0, 7] = nan[0, 9] = nan[2, 4000] = float("nan")
    for x in (ties, nan, torch.full((3, 4099), float("-inf"), dtype=dtype)):
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(nan)[0] == 7 and row_argmax(ties).tolist() == [r.tolist().index(3) for r in ties]
