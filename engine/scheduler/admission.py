"""Prefill admission (SGLang's PrefillAdder): which waiting requests join the next extend batch.

Budget, in pages: what the pool can give (free + evictable) minus what the running requests are
expected to still need, ``remaining_new_tokens * new_token_ratio`` each (1.0 with ``ignore_eos``).
A candidate is admitted when its uncached prompt plus its own reservation fits; the first one that
does not fit stops admission (``NO_TOKEN``: order is FCFS, later ones must not overtake it).
Admitted requests get all the pages for their prompt at once, so chunked prefill never stalls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from cache.page_count import PageCount
from configs.scheduler import SchedulerConfig
from engine.prompt_logprobs import wants_prompt_logprobs
from engine.request import Phase, Request
from engine.scheduler.stats import SchedulerStats


@dataclass
class ExtendItem:
    """``req`` computes tokens ``[req.kv_len, req.kv_len + length)`` of ``req.all_ids`` this step."""

    req: Request
    length: int

    @property
    def completes(self) -> bool:
        return self.req.kv_len + self.length == self.req.seq_len


def admit_prompt(
    kv: KVManager,
    req: Request,
    n_tokens: int,
    extra: PageCount,
    budget: PageCount,
    swa_from: int = 0,
    swa_chunk: int | None = None,
) -> PageCount | None:
    """Give ``req`` its cached prefix plus pages for ``n_tokens`` of ``all_ids`` (SWA pages from
    ``swa_from``, for the first ``swa_chunk`` uncached tokens only when given) if they (and
    ``extra``) fit in ``budget``: sets ``req.kv`` and ``req.kv_len`` (the cached tokens). Returns
    the pages charged, or None with ``req`` untouched."""
    # prompt logprobs need the logits of every prompt position: no cached prefix for them
    ids = [] if wants_prompt_logprobs(req) else req.all_ids
    got = kv.reserve_prompt(ids, n_tokens, extra, budget, swa_from, swa_chunk)
    if got is None:
        return None
    req.kv, charged = got
    req.kv_len = req.kv.cached_tokens
    return charged


class Admission:
    """Builds one extend batch per call; keeps at most one partially prefilled (chunked) request.

    ``reserve_decode=False`` (prefill workers) admits on prompt pages alone: the decode tokens
    are reserved on the decode worker.
    """

    def __init__(self, cfg: SchedulerConfig, kv: KVManager, stats: SchedulerStats, reserve_decode: bool = True) -> None:
        self.cfg = cfg
        self.kv = kv
        self.budget = PageBudget(kv)
        self.stats = stats  # cached_prompt_tokens: radix hits of first admissions (not recomputes)
        self.reserve_decode = reserve_decode
        self.chunked: Request | None = None

    def select(
        self, waiting: deque[Request], running: Iterable[Request], ratio: float, token_budget: int | None = None
    ) -> list[ExtendItem]:
        """The next extend batch: the chunked request's next chunk first, then waiting requests in
        order, at most ``chunked_prefill_size`` tokens (and ``token_budget``, when given: what a
        mixed step leaves after its decode rows) in all. Admitted requests leave ``waiting``."""
        running = list(running)
        budget = (
            self.cfg.chunked_prefill_size if token_budget is None else min(self.cfg.chunked_prefill_size, token_budget)
        )
        items: list[ExtendItem] = []
        if budget <= 0:
            return items
        if self._continuations_first(waiting):
            budget = min(budget, self.cfg.continuation_forward_tokens)
        if self.chunked is not None:
            req = self.chunked
            if not self.kv.ensure_pages(req.kv, req.kv_len + min(req.seq_len - req.kv_len, max(budget, 1))):
                return []  # its next chunk's SWA pages are not free yet: decode first, which frees some
            self.chunked = None
            items.append(self._chunk(req, budget))
            budget -= items[-1].length
        free_pages = self.budget.headroom(running, ratio) if self.reserve_decode else self.kv.available()
        while waiting and budget > 0 and self.chunked is None:
            if len(running) + len(items) >= self.cfg.max_running_requests:
                break
            req = waiting[0]
            need = admit_prompt(
                self.kv, req, req.seq_len, self._reservation_pages(req, ratio), free_pages, swa_chunk=max(budget, 1)
            )
            if need is None:
                break
            req.status = Phase.PREFILLING
            req.mark("admitted")
            if req.retraction_count == 0:
                self.stats.cached_prompt_tokens += req.kv_len
            if req.continuation:
                self.stats.continuation_cached_tokens += req.kv_len
            waiting.popleft()
            free_pages -= need
            items.append(self._chunk(req, budget))
            budget -= items[-1].length
        self.stats.continuation_prefill_tokens += sum(i.length for i in items if i.req.continuation)
        return items

    def _continuations_first(self, waiting: deque[Request]) -> bool:
        """With ``continuation_forward_tokens`` set: the waiting failover continuations move to the front
        of ``waiting``, fewest tokens (prompt + sent) first, the others keeping their order; True when
        this forward computes a continuation (the chunked request is one, or one waits), so its tokens
        are capped. Shortest first: on a forward whose cost is linear in its tokens, each continuation
        of a burst then waits for its own and the shorter ones' compute only."""
        if not self.cfg.continuation_forward_tokens:
            return False
        if any(r.continuation for r in waiting):
            ordered = sorted(waiting, key=lambda r: (not r.continuation, r.seq_len if r.continuation else 0))
            waiting.clear()
            waiting.extend(ordered)
            return True
        return self.chunked is not None and self.chunked.continuation

    def _reservation_pages(self, req: Request, ratio: float) -> PageCount:
        """Pages beyond the prompt's that the request's future decode tokens are expected to take."""
        if not self.reserve_decode:
            return PageCount()
        return self.budget.prompt_reservation(req, ratio)

    def _chunk(self, req: Request, budget: int) -> ExtendItem:
        length = min(req.seq_len - req.kv_len, max(budget, 1))
        item = ExtendItem(req, length)
        if not item.completes:
            self.chunked = req
        return item

    def drop(self, req: Request) -> bool:
        """Forget ``req`` if it is the chunked request (abort path). True if it was."""
        if self.chunked is req:
            self.chunked = None
            return True
        return False
