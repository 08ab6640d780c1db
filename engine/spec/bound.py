"""The best speedup any per-row draft length can give a batch, from a measured step cost and acceptance.

A decode step of ``rows`` requests in which row i verifies ``k_i`` draft tokens carries ``T = rows + sum k_i``
tokens and costs ``cost(T)`` ms (the measured step cost curve, ``benchmarks.spec_step --curve``). Row i emits
``1 + Q_1 + .. + Q_{k_i}`` tokens in expectation, ``Q_j`` the chance that its first j draft tokens are all
accepted (the product of the per-position acceptance ``a_1 .. a_j``: drafts are accepted as a run). The
decode speedup of a choice is its expected tokens per ms over a plain step's ``rows / cost(rows)``.

For a given total of draft tokens D the best split takes the D largest ``Q_j`` over all rows (each row's
``Q`` does not grow with j, so any prefix choice is a set of leading terms and the largest D terms form
one): so the best over every per-row choice is the best over D of ``(rows + top-D sum) / cost(rows + D)``,
computed exactly here. An oracle that drafted only the tokens to be accepted bounds every rule that
decides from the profile: ``rows (1 + E[accepted]) / cost(rows (1 + E[accepted]))`` at most, and never more
than the curve's own ceiling ``max_T T / cost(T)``.

End to end a sitting spends a share ``f`` of its time in prefill, which drafting does not shorten; a decode
speedup ``s`` gives ``1 / (f + (1 - f) / s)``, so a goal ``g`` needs ``s >= (1 - f) / (1 / g - f)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCurve:
    """Measured ms per step of T tokens, ``points`` sorted by T; ``cost`` interpolates linearly between
    them and extends the last segment's slope past the largest T (the curve is linear there)."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if len(self.points) < 2 or any(a[0] >= b[0] for a, b in zip(self.points, self.points[1:])):
            raise ValueError("a step curve needs two or more points with increasing token counts")

    def cost(self, tokens: float) -> float:
        """ms of a step of ``tokens`` tokens (never below the first point's T: a step has its rows)."""
        pts = self.points
        if tokens < pts[0][0]:
            raise ValueError(f"no cost below the curve's first point ({pts[0][0]} tokens)")
        for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return m0 + (m1 - m0) * (tokens - t0) / (t1 - t0)
        (t0, m0), (t1, m1) = pts[-2], pts[-1]
        return m1 + (m1 - m0) * (tokens - t1) / (t1 - t0)


def sitting_ms(curve: StepCurve, steps: list[int]) -> float:
    """ms of a run of decode steps of ``steps`` tokens each on ``curve``: a step below the curve's first
    point (a batch whose rows have finished) on the first segment's slope extended down, an estimate
    (a smaller batch's fixed cost is the same weight read) that a sitting's tail of few rows needs."""
    (t0, m0), (t1, m1) = curve.points[0], curve.points[1]
    slope = (m1 - m0) / (t1 - t0)
    return sum(curve.cost(t) if t >= t0 else m0 - slope * (t0 - t) for t in steps)


def run_chances(acceptance: list[float]) -> list[float]:
    """``Q_j``: the chance that the first j draft tokens are all accepted, from the per-position
    acceptance ``a_j`` (of position j given the ones before it were accepted)."""
    out, q = [], 1.0
    for a in acceptance:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {a}")
        q *= a
        out.append(q)
    return out


@dataclass(frozen=True)
class Choice:
    """One step's drafting: ``drafts`` per row, its ``tokens`` (rows + drafts), ``emitted`` (expected
    tokens), ``ms`` (its cost) and ``speedup`` (tokens per ms over a plain step's)."""

    drafts: tuple[int, ...]
    tokens: int
    emitted: float
    ms: float
    speedup: float


def evaluate(curve: StepCurve, drafts: list[int], acceptance: list[float], coverage: float = 1.0) -> Choice:
    """The step in which row i drafts ``drafts[i]`` tokens (at most ``len(acceptance)``), every row
    with the per-position ``acceptance``; ``coverage``: the share of rows and steps the drafter has a
    draft for at all (the others decode plain: neither their cost nor their gain counts)."""
    q = run_chances(acceptance)
    if any(not 0 <= k <= len(q) for k in drafts):
        raise ValueError(f"a row drafts 0 to {len(q)} tokens, got {drafts}")
    rows = len(drafts)
    tokens = rows + coverage * sum(drafts)
    emitted = rows + coverage * sum(sum(q[:k]) for k in drafts)
    ms = curve.cost(tokens)
    return Choice(tuple(drafts), round(tokens), emitted, ms, (emitted / ms) / (rows / curve.cost(rows)))


def best(curve: StepCurve, rows: int, acceptance: list[float], coverage: float = 1.0) -> Choice:
    """The per-row draft lengths (0 .. ``len(acceptance)`` each) that maximize expected tokens per ms: for
    each total D the D largest run chances (spread over the rows in turn), the best D (fewest on a tie)."""
    q = run_chances(acceptance)
    top = best_choice = None
    for d in range(rows * len(q) + 1):
        drafts = [d // rows + (i < d % rows) for i in range(rows)]
        c = evaluate(curve, drafts, acceptance, coverage)
        if top is None or c.speedup > top + 1e-12:
            top, best_choice = c.speedup, c
    assert best_choice is not None
    return best_choice


def oracle(curve: StepCurve, rows: int, acceptance: list[float], coverage: float = 1.0) -> float:
    """The decode speedup of drafting exactly the tokens that will be accepted (no rejected work): a bound
    on every rule, given the profile (expected accepted run per row when drafting all positions)."""
    tokens = rows * (1 + coverage * sum(run_chances(acceptance)))
    return (tokens / curve.cost(tokens)) / (rows / curve.cost(rows))


def ceiling(curve: StepCurve, rows: int) -> float:
    """The curve's own limit: every token of the largest measured step accepted, over a plain step."""
    return max((t / m) / (rows / curve.cost(rows)) for t, m in curve.points if t >= rows)


def end_to_end(decode_speedup: float, prefill_share: float) -> float:
    """Output tok/s of a sitting over the same without drafts, its prefill (a share ``prefill_share`` of
    the time without drafts) unchanged and its decode ``decode_speedup`` times faster."""
    if not 0.0 <= prefill_share < 1.0 or decode_speedup <= 0:
        raise ValueError("prefill_share in [0, 1) and a positive speedup")
    return 1.0 / (prefill_share + (1.0 - prefill_share) / decode_speedup)


def decode_needed(goal: float, prefill_share: float) -> float:
    """The decode speedup that makes ``end_to_end`` reach ``goal`` (inf: the prefill alone forbids it)."""
    rest = 1.0 / goal - prefill_share
    return float("inf") if rest <= 0 else (1.0 - prefill_share) / rest
