"""The bound on what any per-row draft length can give a batch (``engine.spec.bound``): the arithmetic,
checked against hand-computed figures and against every per-row choice of a small batch."""

from __future__ import annotations

import itertools

import pytest

from engine.spec import bound

# F + T with F = 12 rows and one row 1 ms: the cost model the rule assumes, in ms.
LINEAR = bound.StepCurve(((2, 14.0), (4, 16.0), (8, 20.0), (16, 28.0)))


def test_curve_interpolates_and_extends_the_last_slope():
    curve = bound.StepCurve(((8, 10.0), (16, 14.0), (24, 22.0)))
    assert curve.cost(8) == 10.0
    assert curve.cost(12) == pytest.approx(12.0)
    assert curve.cost(20) == pytest.approx(18.0)
    assert curve.cost(32) == pytest.approx(30.0)  # past the end: the last segment's 1 ms per token
    with pytest.raises(ValueError):
        curve.cost(4)
    with pytest.raises(ValueError):
        bound.StepCurve(((8, 1.0), (8, 2.0)))


def test_sitting_ms_extends_the_first_slope_below_the_curve():
    curve = bound.StepCurve(((8, 10.0), (12, 12.0), (24, 24.0)))
    assert bound.sitting_ms(curve, [8, 12, 24, 36]) == pytest.approx(10 + 12 + 24 + 36)
    assert bound.sitting_ms(curve, [4, 2]) == pytest.approx(8.0 + 7.0)  # 0.5 ms a token below 8


def test_run_chances_are_the_products_of_the_per_position_acceptance():
    assert bound.run_chances([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    with pytest.raises(ValueError):
        bound.run_chances([1.5])


def test_evaluate_by_hand():
    # 2 rows on F + T: one drafts 2 tokens (accepted 0.5, both 0.25) -> 4 tokens, 16 ms, 2.75 tokens
    c = bound.evaluate(LINEAR, [2, 0], [0.5, 0.5])
    assert (c.tokens, c.emitted, c.ms) == (4, 2.75, 16.0)
    assert c.speedup == pytest.approx((2.75 / 16) / (2 / 14))


@pytest.mark.parametrize("acc", [[0.9, 0.9, 0.9], [0.6, 1.0, 1.0], [0.3, 0.3, 0.3], [1.0, 1.0, 1.0]])
def test_best_is_the_best_of_every_per_row_choice(acc):
    rows = 3
    every = [bound.evaluate(LINEAR, list(ks), acc) for ks in itertools.product(range(len(acc) + 1), repeat=rows)]
    top = bound.best(LINEAR, rows, acc)
    assert top.speedup == pytest.approx(max(c.speedup for c in every))
    assert top.speedup >= 1.0  # drafting nothing is one of the choices


def test_a_weight_bound_batch_drafts_everything_and_a_hopeless_draft_nothing():
    assert bound.best(LINEAR, 2, [1.0, 1.0, 1.0]).drafts == (3, 3)
    assert bound.best(LINEAR, 2, [0.01, 0.01]).drafts == (0, 0)


def test_oracle_and_ceiling_bound_the_best_choice():
    acc = [0.8, 0.9, 0.7]
    top = bound.best(LINEAR, 4, acc)
    q = sum(bound.run_chances(acc))
    assert bound.oracle(LINEAR, 4, acc) == pytest.approx((4 * (1 + q) / LINEAR.cost(4 * (1 + q))) / (4 / 16.0))
    assert top.speedup <= bound.oracle(LINEAR, 4, acc) <= bound.ceiling(LINEAR, 4)
    assert bound.ceiling(LINEAR, 4) == pytest.approx((16 / 28) / (4 / 16))


def test_end_to_end_and_the_decode_speedup_a_goal_needs():
    assert bound.end_to_end(2.0, 0.5) == pytest.approx(1 / 0.75)
    assert bound.end_to_end(1.5, 0.0) == 1.5
    need = bound.decode_needed(1.3, 0.3)
    assert bound.end_to_end(need, 0.3) == pytest.approx(1.3)
    assert bound.decode_needed(1.3, 0.8) == float("inf")  # the prefill alone takes more than 1 / 1.3


def test_coverage_counts_only_the_rows_that_have_a_draft():
    # 2 rows, each with a draft half the time: 1 draft token and 0.5 expected accepted per step
    c = bound.evaluate(LINEAR, [1, 1], [1.0], coverage=0.5)
    assert (c.tokens, c.emitted, c.ms) == (3, 3.0, 15.0)
    assert bound.best(LINEAR, 2, [1.0, 1.0, 1.0], coverage=0.5).speedup < bound.best(LINEAR, 2, [1.0] * 3).speedup
    assert bound.oracle(LINEAR, 2, [1.0], coverage=0.0) == 1.0
