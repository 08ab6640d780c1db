"""Cache-aware routing (``--routing cache-aware``): the pair whose radix caches hold the prompt.

For a prompt of ``N`` tokens, ``hit(w)`` is the prefix worker ``w`` holds according to the
router's ``KvIndex`` (whole pages, in tokens, at most ``N - 1``: the last prompt token is always
computed) and ``q(w)`` is its load in requests (``BlendedLoad``'s first element: the larger of
this router's requests in flight there and what the worker reported holding). One cost, in
prompt tokens:

    cost(p, d) = (N - hit(p))                 prefill work left on the prefill worker
               + SHIP_WEIGHT * (N - hit(d))    pages the prefill side ships (decode holds the rest)
               + LOAD_WEIGHT * N * (q(p) + q(d))

and for a colocated replica ``cost(w) = (N - hit(w)) + LOAD_WEIGHT * N * q(w)``. SHIP_WEIGHT = 0.5
(shipping a token's KV costs less than computing it); LOAD_WEIGHT = 0.5: a request already queued
on a worker counts as half this prompt's full prefill, so a worker holding the whole prompt wins
until it holds two more requests than an empty one. The cheapest pair wins; ties go to the least
loaded (``BlendedLoad`` order, then worker id). The cost is a sum of one term per worker, so the
best pair is the best prefill worker with the best decode worker (O(P + D), not O(P * D)).

The cap: only workers with ``q(w) <= min q of their role + balance_slack`` are candidates, so a hot
prefix cannot pile every request onto the worker that holds it; the rest of its traffic spills to
the least loaded workers, which then cache the prefix too.

Each pick is reported to ``on_decision(reason)``: ``prefix`` (a chosen worker holds part of the
prompt), ``load`` (none of the candidates holds any of it: least loaded), ``cap`` (the cheapest
worker was over the cap, another was chosen).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.page_hash import page_hashes
from server.router.kv_index import KvIndex
from server.router.workers import Load, NoWorkerAvailable, Route, WorkerHandle
from transfer.wire.enums import Role

SHIP_WEIGHT = 0.5
LOAD_WEIGHT = 0.5
DEFAULT_BALANCE_SLACK = 4


@dataclass(frozen=True)
class Scored:
    """One worker's terms for one prompt: tokens it holds (``hit``), load (``q``) and its cost."""

    handle: WorkerHandle
    hit: int
    q: float
    cost: float


def _requests(load: Load, worker_id: str) -> float:
    key = load(worker_id)
    return float(key[0] if isinstance(key, tuple) else key)


class CacheAwarePolicy:
    """A routing policy (``workers.Policy``) scoring workers by the cost in the module docstring."""

    def __init__(self, index: KvIndex, *, balance_slack: int = DEFAULT_BALANCE_SLACK,
                 on_decision: Callable[[str], None] | None = None) -> None:
        if balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {balance_slack}")
        self.index, self.balance_slack, self.on_decision = index, balance_slack, on_decision

    def hit_tokens(self, h: WorkerHandle, prompt_ids: Sequence[int], hashes: dict[int, list[int]]) -> int:
        """Tokens of ``prompt_ids``' prefix ``h`` holds (whole pages, at most ``len - 1``)."""
        if h.stats is None or len(prompt_ids) < 2:
            return 0
        ps = h.stats.page_size
        if ps not in hashes:
            hashes[ps] = page_hashes(prompt_ids[:len(prompt_ids) - 1], ps)
        return self.index.cached_pages(h.worker_id, hashes[ps]) * ps

    def score(self, workers: list[WorkerHandle], load: Load, prompt_ids: Sequence[int], weight: float,
              hashes: dict[int, list[int]]) -> list[Scored]:
        """Each worker's ``Scored`` with its own term of the cost (``weight`` on the uncached part)."""
        n = len(prompt_ids)
        out = []
        for h in workers:
            hit, q = self.hit_tokens(h, prompt_ids, hashes), _requests(load, h.worker_id)
            out.append(Scored(h, hit, q, weight * (n - hit) + LOAD_WEIGHT * n * q))
        return out

    def pick(self, scored: list[Scored], load: Load) -> tuple[Scored, bool]:
        """(the cheapest candidate under the cap, whether the cap changed the pick)."""
        def order(s: Scored):
            return s.cost, load(s.handle.worker_id), s.handle.worker_id
        floor = min(s.q for s in scored)
        best = min(scored, key=order)
        chosen = min((s for s in scored if s.q <= floor + self.balance_slack), key=order)
        return chosen, chosen is not best

    def __call__(self, ready: list[WorkerHandle], load: Load, prompt_ids: Sequence[int] = ()) -> Route:
        """The cheapest route among ``ready`` (PD pair when prefill and decode workers are ready,
        else a colocated replica); raises ``NoWorkerAvailable`` like the least-loaded policies."""
        hashes: dict[int, list[int]] = {}
        prefill = [h for h in ready if h.spec.role == Role.PREFILL]
        decode = [h for h in ready if h.spec.role == Role.DECODE]
        if prefill or decode:
            if not prefill or not decode:
                raise NoWorkerAvailable(f"no ready {Role.PREFILL if not prefill else Role.DECODE} worker")
            p, p_capped = self.pick(self.score(prefill, load, prompt_ids, 1.0, hashes), load)
            d, d_capped = self.pick(self.score(decode, load, prompt_ids, SHIP_WEIGHT, hashes), load)
            self._report(p_capped or d_capped, p.hit or d.hit)
            return Route((p.handle, d.handle), d.handle)
        colocated = [h for h in ready if h.spec.role == Role.COLOCATED]
        if not colocated:
            raise NoWorkerAvailable("no ready colocated worker")
        w, capped = self.pick(self.score(colocated, load, prompt_ids, 1.0, hashes), load)
        self._report(capped, w.hit)
        return Route((w.handle,), w.handle)

    def _report(self, capped: bool, hit: int) -> None:
        if self.on_decision is not None:
            self.on_decision("cap" if capped else "prefix" if hit else "load")
