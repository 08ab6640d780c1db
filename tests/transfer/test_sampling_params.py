"""Tests for SamplingParams (transfer.wire.sampling_params): field validation, defaults, logit-bias
limits, and check_stop. (The sampling pipeline itself: tests/engine/test_sampler.py.)"""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from transfer.wire.sampling_params import SamplingParams, check_stop

# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", 2.0),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop_token_ids", (5, -1)),
    ],
)
def test_invalid_field_raises_with_field_name(field, value):
    with pytest.raises(ValidationError) as ei:
        SamplingParams(**{field: value})
    assert field in str(ei.value)


def test_top_p_message_is_clear():
    with pytest.raises(ValidationError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_unknown_field_rejected():
    with pytest.raises(ValidationError) as ei:
        SamplingParams(temprature=0.5)
    assert "temprature" in str(ei.value)


def test_params_frozen_defaults_and_greedy():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert p.seed is None and p.logprobs is None and p.stop_token_ids == ()
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy
    with pytest.raises(ValidationError):
        p.temperature = 0.0  # frozen
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20


# --------------------------------------------------------------------------- logit bias


@pytest.mark.parametrize(
    "bias,needle",
    [
        ({-1: 1.0}, ">= 0"),
        ({1: 101.0}, "[-100, 100]"),
        ({1: float("nan")}, "[-100, 100]"),
        ({i: 1.0 for i in range(1025)}, "at most 1024"),
    ],
)
def test_logit_bias_validation(bias, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams(logit_bias=bias)


# --------------------------------------------------------------------------- check_stop


def test_check_stop():
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(7,))
    eos = {2}
    assert check_stop(5, p, eos, 1) is None
    assert check_stop(2, p, eos, 1) == "stop"
    assert check_stop(7, p, eos, 1) == "stop"
    assert check_stop(5, p, eos, 3) == "length"
    assert check_stop(2, p, eos, 3) == "stop"  # stop wins over length
    ign = SamplingParams(max_new_tokens=3, stop_token_ids=(7,), ignore_eos=True)
    assert check_stop(2, ign, eos, 1) is None
    assert check_stop(7, ign, eos, 1) == "stop"
    assert check_stop(2, ign, eos, 3) == "length"
    assert check_stop(2, SamplingParams(), [2, 9], 1) == "stop"
