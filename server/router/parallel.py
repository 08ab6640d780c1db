"""Parallel sampling (``n``, ``best_of``): one prompt, several choices, each its own request.

Contract:

- ``check_n(n, best_of, stream)`` validates the counts (``1 <= n <= best_of <= MAX_CHOICES``) and
  refuses ``best_of > n`` with ``stream`` (the best ones are known only at the end), 400 otherwise.
- ``choice_params(params, i)`` gives choice ``i`` its own seed, ``seed + i`` (vLLM's rule), so a
  seeded request is reproducible per choice index while its choices differ; unseeded and greedy
  choices keep the params as they are (greedy choices are then equal, as in vLLM).
- ``best(runs, n)`` keeps the ``n`` runs with the highest cumulative logprob (``best_of``), in
  the order they were generated, renumbered from ``first_index``.

The choices of one prompt go to the same route and all but the first are sent once the first has
its first token (``ChoiceRun.follows``): in PD mode the prefill worker has then cached the
prompt's full pages, so they are computed once. (Colocated workers cache a prompt only when its
request finishes, so there the choices are prefilled together in one batch instead.)
"""

from __future__ import annotations

from server.router.errors import APIError
from transfer.wire.sampling_params import SamplingParams

MAX_CHOICES = 64
"""Most sequences one prompt may ask for (``best_of``, or ``n`` without it)."""

_SEED_MAX = 2**64 - 1


def check_n(n: int | None, best_of: int | None, stream: bool) -> tuple[int, int]:
    """``(n, sequences to generate)``; 400 ``APIError`` naming the field that is out of range."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    gen = n if best_of is None else best_of
    if not n <= gen <= MAX_CHOICES:
        raise APIError(400, f"best_of must be in [n={n}, {MAX_CHOICES}], got {best_of}", param="best_of")
    if gen > n and stream:
        raise APIError(
            400,
            f"best_of={gen} > n={n} cannot be streamed (the best {n} are known only when all "
            f"{gen} have ended); set stream to false or best_of to n",
            param="best_of",
        )
    return n, gen


def choice_params(params: SamplingParams, index: int, ranked: bool = False) -> SamplingParams:
    """``params`` for choice ``index`` of a prompt: the seed becomes ``seed + index`` (wrapping
    within the accepted range); ``ranked`` (best_of) asks for the sampled token's logprob."""
    update = {}
    if params.seed is not None and index:
        seed = params.seed + index
        update["seed"] = seed - 2**64 if seed > _SEED_MAX else seed
    if ranked and params.logprobs is None:
        update["logprobs"] = 0
    return params.model_copy(update=update) if update else params


def cumulative_logprob(logprobs: list[float | None]) -> float:
    """Sum of a choice's token logprobs (``None`` entries count as 0)."""
    return sum(lp for lp in logprobs if lp is not None)


def best(runs: list, n: int, first_index: int = 0) -> list:
    """The ``n`` runs of ``runs`` (one prompt's ``ChoiceRun``s) with the highest cumulative
    logprob, in generation order, their ``index`` set to ``first_index``, ``first_index + 1``, ..."""
    ranked = sorted(range(len(runs)), key=lambda k: -cumulative_logprob(runs[k].logprobs))[:n]
    kept = [runs[k] for k in sorted(ranked)]
    for i, r in enumerate(kept):
        r.index = first_index + i
    return kept
