"""Whether a draft token pays for its place in a step: a fixed rule from measured step costs.

A CPU step of T tokens (decode rows, verified positions and prefill tokens, all decode-stack rows or
extend tokens) costs about ``fixed + T`` units, one unit being one more row: measured with
``benchmarks/spec_step.py``, an 8-row bfloat16 step of the embedded model grows by about one
eighth of a 12-row-equivalent per added row, so ``fixed`` is about 12 rows there
(``SchedulerConfig.spec_step_fixed_tokens``). Adding a draft token to a step costs one unit and
yields its chance of being accepted, ``q``; it raises the step's expected tokens per unit iff
``q * cost > gain`` (``gain``: the tokens the step is expected to give, ``cost``: its units so far).
So at batch 1 (cost ``fixed + 1``, gain 1) a draft pays from ``q`` of about 0.08, at batch 8 from
0.4, at batch 32 from 0.73: a compute-bound batch drafts only what is very likely accepted.

``q`` of the j-th draft token of a request is ``p ** j`` with ``p`` its recent acceptance
(``Acceptance``): drafts are accepted as a run, each token only after the one before it.
Deterministic from the config and the requests' own verify history: every process decides alike,
and the choice never changes a token.
"""

from __future__ import annotations

from dataclasses import dataclass

# The acceptance of a request that has not been verified yet (a prior of one hit and one miss) and
# the weight each earlier verify keeps per later one (half): recent steps count most, as a request moves
# between quoting its context and writing new text.
PRIOR_HITS, PRIOR_MISSES = 1.0, 1.0
DECAY = 0.5


@dataclass
class Acceptance:
    """A request's decayed verify record: ``hits`` (draft tokens accepted) and ``misses`` (drafts
    whose run ended on a rejected token). ``rate`` estimates the chance that a draft token is
    accepted given that the one before it was (the geometric run model's parameter)."""

    hits: float = 0.0
    misses: float = 0.0

    def rate(self) -> float:
        return (self.hits + PRIOR_HITS) / (self.hits + self.misses + PRIOR_HITS + PRIOR_MISSES)

    def observe(self, accepted: int, drafted: int) -> None:
        """Record one verify: ``accepted`` of ``drafted`` draft tokens (a run from the first)."""
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)


class StepBudget:
    """One step's cost model while its rows are drafted in order: ``cost`` units (``fixed`` plus one
    per token) and ``gain`` (expected tokens: one per decode row and prefill token, plus each draft
    token's chance of acceptance)."""

    def __init__(self, fixed: float, tokens: int) -> None:
        self.cost = fixed + tokens
        self.gain = float(tokens)

    def paying(self, p: float, n: int) -> int:
        """How many leading tokens of a draft of ``n`` tokens with per-token rate ``p`` pay, each
        counted into the step as it is taken (call ``take`` with the length drafted in the end)."""
        cost, gain, q = self.cost, self.gain, 1.0
        for j in range(n):
            q *= p
            if q * cost <= gain:
                return j
            cost, gain = cost + 1, gain + q
        return n

    def take(self, p: float, n: int) -> None:
        """Count a draft of ``n`` tokens with per-token rate ``p`` into the step."""
        q = 1.0
        for _ in range(n):
            q *= p
            self.cost, self.gain = self.cost + 1, self.gain + q
