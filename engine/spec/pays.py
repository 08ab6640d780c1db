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
# A step in which a request could draft but did not (the rule kept it off) keeps this much of its
# record: its estimate drifts back to the prior, so a request switched off in a batch where the prior
# pays is probed again after a few steps (about 7 after two misses at batch 8) instead of never.
IDLE_DECAY = 0.85
# Each token a draft's source matches the sequence's suffix beyond the shortest n-gram adds half a
# pseudo-hit to the prior, up to MATCH_TOKENS tokens: a long match (the answer quoting its passage,
# a loop) predicts acceptance before any verify (16 tokens past the shortest: a fresh estimate of 0.9).
MATCH_TOKENS = 16
MATCH_WEIGHT = 0.5


@dataclass
class Acceptance:
    """A request's decayed verify record: ``hits`` (draft tokens accepted) and ``misses`` (drafts
    whose run ended on a rejected token). ``rate`` estimates the chance that a draft token is
    accepted given that the one before it was (the geometric run model's parameter)."""

    hits: float = 0.0
    misses: float = 0.0

    def rate(self, match: int = 0) -> float:
        """The estimate, with ``match`` extra matched tokens (``match_tokens``) raising the prior."""
        prior = PRIOR_HITS + MATCH_WEIGHT * min(max(match, 0), MATCH_TOKENS)
        return (self.hits + prior) / (self.hits + self.misses + prior + PRIOR_MISSES)

    def idle(self) -> None:
        """A step the request could have drafted in and did not: the record fades toward the prior."""
        self.hits *= IDLE_DECAY
        self.misses *= IDLE_DECAY

    def observe(self, accepted: int, drafted: int) -> None:
        """Record one verify: ``accepted`` of ``drafted`` draft tokens (a run from the first)."""
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < drafted)


# The chance of acceptance a draft token must have to pay at the largest drafting step when no cap is
# configured: a step of T tokens needs T / (fixed + T), so the cap is 2 * fixed (see ``step_cap``).
CAP_BREAK_EVEN = 2 / 3


def step_cap(fixed: float, linear: int) -> int:
    """The most tokens a drafting step may carry when no cap is configured: the step at which a draft
    token needs a ``CAP_BREAK_EVEN`` (2/3) chance of acceptance to pay, ``2 * fixed``, and never more
    than ``linear``, the largest step over which ``fixed + T`` was measured to hold (the cost rule is
    not trusted past its fit). The measured curve (``benchmarks.spec_step --curve``) stays linear up to
    96 tokens; a 3/4 break-even (``3 * fixed``, 28 draft tokens at batch 8 instead of 16) ran slower on
    the grounded workload at c = 8 (docs/design/speculative.md), so the acceptance estimate, not the
    cost fit, limits the cap. A batch of ``2 * fixed`` rows or more (24 at fixed 12) does not draft.
    Infinite ``fixed``: no cap."""
    if fixed == float("inf"):
        return 1 << 30
    return max(1, min(linear, int(fixed * CAP_BREAK_EVEN / (1 - CAP_BREAK_EVEN) + 1e-6)))


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
