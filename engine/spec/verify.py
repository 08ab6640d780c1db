"""Speculative verify for decode rows: drafts in, pages for them, exact acceptance, rollback.

One step of a drafting request feeds ``[last token, d1 .. dK]`` at its ``kv_len`` (as K + 1
one-token decode rows, ``executor.verify_rows``) and takes the logits of all K + 1 positions. ``accept``
then draws the target token of each position exactly as a decode step would (the same ``Sampler``
over that position's logits with the request's own ``SamplerState``: greedy argmax, or the seeded
generator at that output index, with penalties and ``logit_bias`` seeing the tokens accepted before
it), appends it through ``token_delta`` (stop checks, ``max_tokens``, EOS, ``stop_token_ids``), and
goes on only while the token equals the draft. So the tokens emitted are the ones decoding without
drafts would give; a step emits between 1 and K + 1 of them. ``rollback`` gives back the pages that
only held rejected positions (the radix cache sees ``all_ids[:kv_len]`` only, never a rejected
token).

A request whose draft was wholly rejected skips drafting for a few steps (``MAX_BACKOFF_STEPS``).
Drafting is skipped, fail safe, for a row whose extra pages are not free without evicting the
radix cache (the step then decodes it as usual). A structured-output row drafts too: ``accept``
draws position j only after the tokens before it were emitted, so its mask is the matcher's
advanced over the accepted tokens (which equal the drafts up to j) and a rejected draft token is
never consumed: nothing to roll back. Its draft is cut to the prefix the grammar allows (a token
past it could not be accepted). On an SWA pool the draft positions take SWA pages too, and the
pages that left the window go back after the step as after a decode step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cache.kv_manager import KVManager, truncate
from cache.page_count import PageCount
from configs.scheduler import SchedulerConfig
from engine.request import Request
from engine.sampling import Sampler
from engine.scheduler.stats import Histogram
from engine.spec.ngram import NgramIndex
from engine.spec.pays import MATCH_TOKENS, Acceptance, StepBudget, step_cap
from transfer.wire.protocol import DraftRecord, TokenDelta

EmitToken = Callable[[Request, int, "float | None", "list | None"], TokenDelta]

# Back-off of a request whose draft was wholly rejected: it skips drafting for this many steps,
# doubled on each further miss up to MAX_BACKOFF_STEPS, and back to none on an accepted token. A
# rejected draft is pure cost (K extra rows in the step), so a request whose output
# is not in its context soon drafts rarely, while one that quotes its input drafts every step.
MAX_BACKOFF_STEPS = 32
# A wholly rejected draft of a request whose record before it estimates at least this acceptance (and
# whose last verify accepted a token) does not start the back-off: after a run of accepted drafts one
# miss is a poor sign that drafting stopped paying, and the cost rule, fed the miss, still decides how
# much the next step drafts. A miss that leaves the estimate below this backs off as usual.
REPROBE_RATE = 0.75
# Buckets of pdserve_spec_acceptance_length (draft tokens accepted per verified row): one per count
# up to 8, then coarser up to the largest num_speculative_tokens.
ACCEPTANCE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


@dataclass
class Coverage:
    """Why each row-step of a drafting-capable step did or did not carry a draft (one count per row
    per step ``drafts`` decided): ``drafted``; ``backed_off`` (waiting after a wholly rejected draft);
    ``no_match`` (no suffix of length ``ngram_min`` .. ``ngram_max`` recurs, or the grammar allows none
    of the draft); ``at_limit`` (``max_tokens`` or the context leave no room); ``dropped`` (a draft was
    found but the cost rule, the step's cap or the free pages left none of it); ``full`` (the step was
    full without drafts: nothing looked up)."""

    drafted: int = 0
    backed_off: int = 0
    no_match: int = 0
    at_limit: int = 0
    dropped: int = 0
    full: int = 0


@dataclass
class _Drafting:
    """One request's drafting state: its n-gram index, its back-off and its recent acceptance."""

    index: NgramIndex
    acceptance: Acceptance = field(default_factory=Acceptance)
    wait: int = 0  # steps left before it drafts again
    backoff: int = 0  # the wait after its next wholly rejected draft


class NgramSpeculator:
    """Per-request n-gram drafts and their verification; one per scheduler (single thread).

    ``step_tokens``: the most tokens a step that drafts may carry (decode rows, prefill tokens and
    drafted tokens together; ``drafts`` trims to it). ``fixed``: a step's fixed cost in token rows
    (``engine.spec.pays``): a draft token is verified only where its chance of acceptance pays for
    its row (infinite: whenever ``step_tokens`` allows). Counters: ``draft_tokens`` (draft tokens
    verified), ``accepted_tokens`` (of those, accepted); ``acceptance``: accepted tokens per verified row;
    ``position_trials[j]`` / ``position_hits[j]``: draft tokens at position j + 1 verified (the ones before
    them accepted) / accepted, the per-position acceptance ``benchmarks.spec_step --bound`` reads.
    """

    def __init__(
        self,
        kv: KVManager,
        k: int,
        n_min: int,
        n_max: int,
        max_model_len: int,
        step_tokens: int = 1 << 30,
        fixed: float = float("inf"),
    ) -> None:
        self.kv = kv
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.max_model_len = max_model_len
        self.step_tokens = step_tokens
        self.fixed = fixed
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.acceptance = Histogram(ACCEPTANCE_BUCKETS)
        self.position_trials, self.position_hits = [0] * k, [0] * k
        self.coverage = Coverage()
        # a request's index lives as long as the request (no registry to clean up)
        self._state: weakref.WeakKeyDictionary[Request, _Drafting] = weakref.WeakKeyDictionary()

    def series(self) -> tuple[dict[str, int], dict[str, Histogram]]:
        """The metric series of a worker that speculates: (counters, histograms) for its ``Snapshot``,
        the same names in colocated and decode workers."""
        counters = dict(spec_draft_tokens=self.draft_tokens, spec_accepted_tokens=self.accepted_tokens)
        return counters, {"spec_acceptance_length": self.acceptance}

    def record(self, req: Request) -> DraftRecord | None:
        """``req``'s acceptance record and back-off, to travel with it to a peer decode worker (None:
        it has none yet, so the peer's prior is as good)."""
        st = self._state.get(req)
        if st is None:
            return None
        a = st.acceptance
        return DraftRecord(hits=a.hits, misses=a.misses, wait=st.wait, backoff=st.backoff)

    def adopt(self, req: Request, record: DraftRecord) -> None:
        """Give ``req`` (a request migrated here) the ``record`` it had on its source: it drafts as it
        would have there (its n-gram index is built from its ids on its first step, as always)."""
        st = self._drafting(req)
        st.acceptance = Acceptance(hits=record.hits, misses=record.misses)
        st.wait, st.backoff = record.wait, min(record.backoff, MAX_BACKOFF_STEPS)

    def _drafting(self, req: Request) -> _Drafting:
        st = self._state.get(req)
        if st is None:
            st = self._state[req] = _Drafting(NgramIndex(self.n_min, self.n_max))
        return st

    @staticmethod
    def _synced(ix: NgramIndex, req: Request) -> NgramIndex:
        """``ix`` fed with the tokens ``req`` gained since the last call."""
        n_prompt = len(req.prompt_ids)
        if len(ix) < n_prompt:
            ix.extend(req.prompt_ids[len(ix) :])
        ix.extend(req.output_ids[len(ix) - n_prompt :])
        return ix

    def drafts(self, reqs: list[Request], other_tokens: int) -> list[list[int]]:
        """The draft of each of ``reqs`` (decode rows of one step beside ``other_tokens`` prefill
        tokens), pages taken: a step whose rows, prefill and drafts would pass ``step_tokens`` drafts
        only what fits, and each row drafts only the tokens that pay for their rows at its estimated
        acceptance (``StepBudget``; the estimate: its verify record, with a prior raised by how long
        its n-gram match is), rows with the highest estimate first (ties in batch order), so a
        large, compute-bound batch drafts little or nothing. A row that could have drafted and did
        not lets its record fade toward the prior (``Acceptance.idle``): it is probed again later.
        Deterministic from the config, the batch and the requests' tokens and verify history:
        every process decides alike."""
        out: list[list[int]] = [[] for _ in reqs]
        room = self.step_tokens - len(reqs) - other_tokens
        if room <= 0:  # the step is full without drafts: nothing to decide, nothing to learn
            self.coverage.full += len(reqs)
            return out
        budget = StepBudget(self.fixed, len(reqs) + other_tokens)
        ranked = []
        for i, r in enumerate(reqs):
            st, (d, match) = self._drafting(r), self._proposal(r)
            ranked.append((-st.acceptance.rate(match), i, d))
        for neg_p, i, d in sorted(ranked, key=lambda c: (c[0], c[1])):
            n = budget.paying(-neg_p, min(room, len(d))) if room > 0 else 0
            out[i] = self._with_pages(reqs[i], d[:n]) if n > 0 else []
            budget.take(-neg_p, len(out[i]))
            room -= len(out[i])
            if not out[i]:
                self._drafting(reqs[i]).acceptance.idle()
            if d:
                self.coverage.drafted += bool(out[i])
                self.coverage.dropped += not out[i]
        return out

    def draft(self, req: Request, limit: int | None = None) -> list[int]:
        """Draft tokens for ``req``'s next step, with pages for them taken (``[]``: decode as usual).

        At most ``k`` (and ``limit``), never past ``max_tokens`` or the context; ``req`` must hold the
        pages of position ``kv_len`` already (``RunningBatch.prepare_decode``)."""
        d = self._proposal(req)[0]
        return self._with_pages(req, d[:limit] if limit is not None else d)

    def _proposal(self, req: Request) -> tuple[list[int], int]:
        """``(draft, matched tokens past ngram_min)`` for ``req``'s next step, no pages taken:
        ``[]`` while it backs off (one step of its wait counted), at its limits, or with no match;
        a structured-output draft cut to what its grammar allows."""
        k = min(self.k, req.remaining_new_tokens() - 1, self.max_model_len - req.seq_len - 1)
        if k <= 0:
            self.coverage.at_limit += 1
            return [], 0
        st = self._drafting(req)
        if st.wait > 0:
            st.wait -= 1
            self.coverage.backed_off += 1
            return [], 0
        d, match = self._synced(st.index, req).lookup(k, self.n_min + MATCH_TOKENS)
        if d and (matcher := req.sampler_state.matcher) is not None:
            d = d[: matcher.valid_prefix(d)]  # the grammar would mask the rest: it cannot be accepted
        self.coverage.no_match += not d
        return d, max(0, match - self.n_min) if d else 0

    def _with_pages(self, req: Request, d: list[int]) -> list[int]:
        """``d`` with pages taken for its positions, or ``[]`` where they are not free."""
        if not d:
            return []
        end = req.kv_len + 1 + len(d)
        kv = self.kv
        free = PageCount(kv.allocator.num_free(), kv.swa_allocator.num_free() if kv.has_swa else 0)
        if not free.covers(kv.prompt_demand(req.kv, end)) or not kv.ensure_pages(req.kv, end):
            return []  # speculation never evicts cached prefixes nor outgrows the pool
        return d

    def accept(
        self,
        sampler: Sampler,
        rows: list[tuple[Request, list[int], torch.Tensor]],
        emit: EmitToken,
    ) -> list[tuple[Request, TokenDelta]]:
        """Verify ``rows`` of (request, draft, logits ``[len(draft) + 1, V]`` of positions
        ``kv_len ..``): the deltas of the tokens emitted, one per token, in order per request.
        Each request's ``kv_len`` advances by its emitted count and its rejected pages go back."""
        out: list[tuple[Request, TokenDelta]] = []
        emitted, accepted = [0] * len(rows), [0] * len(rows)
        active = list(range(len(rows)))
        j = 0
        while active:
            reqs = [rows[a][0] for a in active]
            x = torch.stack([rows[a][2][j] for a in active])
            s = sampler.sample(x, [r.params for r in reqs], [r.sampler_state for r in reqs])
            still = []
            for n, a in enumerate(active):
                req, d, _ = rows[a]
                tok = s.token_ids[n]
                out.append((req, emit(req, tok, s.logprobs[n], s.top_logprobs[n])))
                emitted[a] += 1
                hit = j < len(d) and tok == d[j]
                accepted[a] += hit
                if j < len(d):
                    self.position_trials[j] += 1
                    self.position_hits[j] += hit
                if hit and not req.finished:
                    still.append(a)
            active, j = still, j + 1
        for (req, d, _), m, acc in zip(rows, emitted, accepted):
            self.draft_tokens += len(d)
            self.accepted_tokens += acc
            self.acceptance.observe(acc)
            st = self._drafting(req)
            forgiven = not acc and st.backoff == 0 and st.acceptance.rate() >= REPROBE_RATE
            st.acceptance.observe(acc, len(d))
            if not forgiven:
                st.backoff = 0 if acc else min(max(1, 2 * st.backoff), MAX_BACKOFF_STEPS)
            st.wait = st.backoff
            req.kv_len += m
            truncate(self.kv, req.kv, req.kv_len)
            self.kv.release_window(req.kv, req.kv_len)
        return out


def speculator_for(cfg: SchedulerConfig, kv: KVManager, max_model_len: int) -> NgramSpeculator | None:
    """The speculator ``cfg.speculative_method`` asks for, or None (``off``: the plain decode path)."""
    if cfg.speculative_method != "ngram":
        return None
    k = cfg.num_speculative_tokens
    fixed = cfg.spec_step_fixed_tokens
    cap = cfg.spec_max_batch_tokens
    if cap is None:
        cap = step_cap(fixed, cfg.spec_step_linear_tokens)
    step_tokens = min(cap, cfg.max_num_batched_tokens or cap)
    return NgramSpeculator(kv, k, cfg.ngram_min, cfg.ngram_max, max_model_len, step_tokens, fixed)
