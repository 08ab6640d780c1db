"""The n-gram drafter: longest suffix match, most recent occurrence, incremental index."""

from __future__ import annotations

import random

import pytest

from engine.spec.ngram import NgramIndex


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The definition: longest suffix (n_max..n_min) with an earlier occurrence, latest one wins,
    and what followed it, extended as if the sequence kept repeating from there."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                seq = list(tokens)  # the continuation of a loop with period L - (start + n)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[L:]
    return []


def index_of(tokens, n_min=1, n_max=3):
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


def test_repeated_passage_proposes_its_continuation():
    passage = [5, 6, 7, 8, 9, 10]
    ix = index_of([1, *passage, 2, 5, 6], n_min=2, n_max=3)
    assert ix.propose(3) == [7, 8, 9]


def test_prefers_longest_suffix_then_most_recent():
    # suffix (1, 2): latest earlier use is followed by 4; the longer (0, 1, 2) is followed by 3
    ix = index_of([0, 1, 2, 3, 9, 1, 2, 4, 0, 1, 2], n_min=1, n_max=3)
    assert ix.propose(1) == [3]
    ix2 = index_of([7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2], n_min=1, n_max=3)
    assert ix2.propose(1) == [4]  # (7,1,2) does not recur; of the (1,2) uses the latest wins


def test_no_match_and_bounds():
    assert index_of([1, 2, 3, 4]).propose(4) == []
    assert index_of([]).propose(4) == []
    assert index_of([3, 3]).propose(0) == []
    assert index_of([3, 3], n_min=1, n_max=1).propose(5) == [3] * 5  # a loop drafts on past the end
    assert index_of([1, 2, 3, 1, 2], n_min=2, n_max=2).propose(5) == [3, 1, 2, 3, 1]
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_equals_brute_force(seed):
    rng = random.Random(seed)
    n_min, n_max, k = rng.randint(1, 2), rng.randint(2, 4), rng.randint(1, 5)
    tokens = [rng.randint(0, 4) for _ in range(120)]
    ix = NgramIndex(n_min, n_max)
    for t in tokens:  # token by token, as a decode step feeds it
        ix.extend([t])
        assert ix.propose(k) == brute_force(ix.tokens, n_min, n_max, k)


def test_config_fields_on_by_default_and_checked():
    from configs.scheduler import SchedulerConfig

    assert SchedulerConfig().speculative_method == "ngram"
    assert SchedulerConfig(speculative_method="off").speculative_method == "off"
    cfg = SchedulerConfig(speculative_method="ngram", num_speculative_tokens=3, ngram_min=2, ngram_max=5)
    assert (cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max) == (3, 2, 5)
    with pytest.raises(ValueError, match="ngram_min"):
        SchedulerConfig(ngram_min=4, ngram_max=2)
    with pytest.raises(ValueError):
        SchedulerConfig(speculative_method="eagle")


def test_speculative_config_json_sets_the_fields():
    from configs.scheduler import SchedulerConfig

    js = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    cfg = SchedulerConfig(speculative_config=js)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max) == ("ngram", 6, 1, 3)
    assert SchedulerConfig(speculative_config=js, ngram_min=1).ngram_min == 1  # the same value twice is fine
    for bad in ('{"method": "eagle"}', '{"method": "ngram", "k": 2}', "[1]", "{not json"):
        with pytest.raises(ValueError):
            SchedulerConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="ngram_max"):
        SchedulerConfig(speculative_config=js, ngram_max=5)
