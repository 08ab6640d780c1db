"""Cache-aware routing (``--routing cache-aware``): the pair whose radix caches hold the prompt.

For a prompt of ``N`` tokens, ``hit(w)`` is the prefix worker ``w`` holds according to the
router's ``KvIndex`` (whole pages, in tokens, at most ``N - 1``: the last prompt token is always
computed), ``B(w)`` its prefill backlog in uncached prompt tokens (``load.PrefillBacklog``: what
this router sent it that its cache did not hold and whose first token has not come, or what the
worker reports waiting, whichever is larger) and ``q(w)`` its load in requests (``BlendedLoad``'s
first element). One cost, in prompt tokens (computing one prompt token is the unit):

    P(p)        = (N - hit(p)) + B(p)                           prefill on prefill worker p
    remote(p,d) = P(p) + SHIP_WEIGHT * (N - hit(d)) + R * q(d)  ... and ship what d lacks
    local(d)    = (N - hit(d)) + B(d) + R * q(d)                d prefills the suffix itself

``local(d)`` is the decode worker's own option (selective disaggregation, ``decode_worker.
local_prefill``): a decode worker that reports ``local_prefill_max_tokens`` M > 0 prefills a
request itself when its uncached suffix plus its local backlog is at most M, and then nothing is
shipped and the prefill worker is not involved. A decode worker holds each conversation's whole
history (prompt and the answer it decoded), so the next turn's suffix there is only the new
question: that is the route for turn k+1 where turn k decoded. The router predicts that decision
with the same rule (on its index, a heartbeat late; the decode worker decides on its exact cache),
so ``cost(d) = local(d)`` when it applies, else ``remote(best p, d)``. Either way the router sends
the request to a prefill worker too (the cheapest), which the decode worker withdraws it from when
it prefills itself (``PrefillWithdrawn``): a refused local prefill costs nothing more.

SHIP_WEIGHT = 0.5: shipping a token's KV costs less than computing it. R = DECODE_REQUEST_TOKENS
= 64: a request a decode worker (or colocated replica) holds slows its every step, as much as 64
prompt tokens of work for this request. The load term counts work, not requests: a worker with a
queue of mostly cached prompts is cheap, one with a long uncached prompt ahead is not, so late
turns of long conversations spread by the work they bring. A colocated replica costs
``(N - hit(w)) + B(w) + R * q(w)``, from the same index. Prefill workers are picked by ``P``, then
decode workers by ``cost(d)`` given that prefill worker: O(P + D), not O(P * D). Ties go to the
least loaded (``BlendedLoad`` order, then worker id).

The cap: only workers with ``q(w) <= min q of their role + balance_slack`` are candidates, so a hot
prefix cannot pile every request onto the worker that holds it; the rest of its traffic spills to
the least loaded workers, which then cache the prefix too.

``Route.prefill`` names where the prompt is expected to be computed and its uncached tokens there
(the decode worker when ``local(d)`` applies, else the prefill worker): the in-flight table counts
them in that worker's ``B`` until the first token.

Each pick is reported to ``on_decision(reason)``: ``cap`` (the cheapest worker was over the cap,
another was chosen), ``local`` (the decode worker is expected to prefill it itself), ``prefix`` (a
chosen worker holds part of the prompt), ``load`` (none of the candidates holds any of it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.page_hash import page_hashes
from server.router.kv_index import KvIndex
from server.router.workers import Load, NoWorkerAvailable, Route, WorkerHandle
from transfer.wire.enums import Role

SHIP_WEIGHT = 0.5
DECODE_REQUEST_TOKENS = 64
DEFAULT_BALANCE_SLACK = 4
LOCAL_MAX_GAUGE = "local_prefill_max_tokens"  # a decode worker's --local-prefill-max-tokens (0: off)

Backlog = Callable[[str], int]  # worker id -> waiting prompt work in uncached tokens


@dataclass(frozen=True)
class Scored:
    """One worker's terms for one prompt: tokens it holds (``hit``), load in requests (``q``),
    backlog in tokens, its cost, and (decode workers) whether it is expected to prefill locally."""

    handle: WorkerHandle
    hit: int
    q: float
    backlog: int
    cost: float
    local: bool = False

    def prefill_at(self, n: int) -> tuple[str, int]:
        """(this worker's id, the prompt tokens it computes) for ``Route.prefill``."""
        return self.handle.worker_id, n - self.hit


def _requests(load: Load, worker_id: str) -> float:
    key = load(worker_id)
    return float(key[0] if isinstance(key, tuple) else key)


def local_prefill_max(h: WorkerHandle) -> int:
    """The decode worker's ``--local-prefill-max-tokens`` as its stats report it (0: off or unknown)."""
    return int(h.stats.gauges.get(LOCAL_MAX_GAUGE, 0.0)) if h.stats is not None else 0


class CacheAwarePolicy:
    """A routing policy (``workers.Policy``) scoring workers by the cost in the module docstring.
    ``backlog``: each worker's ``B`` (``load.PrefillBacklog``; none: every backlog is 0)."""

    def __init__(
        self,
        index: KvIndex,
        *,
        backlog: Backlog | None = None,
        balance_slack: int = DEFAULT_BALANCE_SLACK,
        on_decision: Callable[[str], None] | None = None,
    ) -> None:
        if balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {balance_slack}")
        self.index, self.balance_slack, self.on_decision = index, balance_slack, on_decision
        self.backlog: Backlog = backlog or (lambda _worker_id: 0)

    def hit_tokens(self, h: WorkerHandle, prompt_ids: Sequence[int], hashes: dict[int, list[int]]) -> int:
        """Tokens of ``prompt_ids``' prefix ``h`` holds (whole pages, at most ``len - 1``)."""
        if h.stats is None or len(prompt_ids) < 2:
            return 0
        ps = h.stats.page_size
        if ps not in hashes:
            hashes[ps] = page_hashes(prompt_ids[: len(prompt_ids) - 1], ps)
        return self.index.cached_pages(h.worker_id, hashes[ps]) * ps

    def score_prefill(
        self,
        workers: list[WorkerHandle],
        load: Load,
        prompt_ids: Sequence[int],
        hashes: dict[int, list[int]],
        decodes: bool,
    ) -> list[Scored]:
        """``P(w)`` of each worker (``decodes``: plus ``R * q(w)``, a colocated replica's cost)."""
        n, out = len(prompt_ids), []
        for h in workers:
            hit, q, b = self.hit_tokens(h, prompt_ids, hashes), _requests(load, h.worker_id), self.backlog(h.worker_id)
            out.append(Scored(h, hit, q, b, (n - hit) + b + (DECODE_REQUEST_TOKENS * q if decodes else 0.0)))
        return out

    def score_decode(
        self,
        workers: list[WorkerHandle],
        load: Load,
        prompt_ids: Sequence[int],
        hashes: dict[int, list[int]],
        prefill_cost: float,
    ) -> list[Scored]:
        """``cost(d)`` of each decode worker given the chosen prefill worker's ``P`` (``prefill_cost``)."""
        n, out = len(prompt_ids), []
        for h in workers:
            hit, q, b = self.hit_tokens(h, prompt_ids, hashes), _requests(load, h.worker_id), self.backlog(h.worker_id)
            suffix, limit = n - hit, local_prefill_max(h)
            local = limit > 0 and suffix + b <= limit
            cost = (suffix + b if local else prefill_cost + SHIP_WEIGHT * suffix) + DECODE_REQUEST_TOKENS * q
            out.append(Scored(h, hit, q, b, cost, local))
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
        n = len(prompt_ids)
        prefill = [h for h in ready if h.spec.role == Role.PREFILL]
        decode = [h for h in ready if h.spec.role == Role.DECODE]
        if prefill or decode:
            if not prefill or not decode:
                raise NoWorkerAvailable(f"no ready {Role.PREFILL if not prefill else Role.DECODE} worker")
            p, p_capped = self.pick(self.score_prefill(prefill, load, prompt_ids, hashes, decodes=False), load)
            d, d_capped = self.pick(self.score_decode(decode, load, prompt_ids, hashes, p.cost), load)
            self._report(p_capped or d_capped, d.local, bool(d.hit if d.local else p.hit or d.hit))
            return Route((p.handle, d.handle), d.handle, prefill=(d if d.local else p).prefill_at(n))
        colocated = [h for h in ready if h.spec.role == Role.COLOCATED]
        if not colocated:
            raise NoWorkerAvailable("no ready colocated worker")
        w, capped = self.pick(self.score_prefill(colocated, load, prompt_ids, hashes, decodes=True), load)
        self._report(capped, False, bool(w.hit))
        return Route((w.handle,), w.handle, prefill=w.prefill_at(n))

    def _report(self, capped: bool, local: bool, hit: bool) -> None:
        if self.on_decision is not None:
            self.on_decision("cap" if capped else "local" if local else "prefix" if hit else "load")
