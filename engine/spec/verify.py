"""Speculative verify for decode rows: drafts in, pages for them, exact acceptance, rollback.

One step of a drafting request feeds ``[last token, d1 .. dK]`` as a small extend at its
``kv_len`` and takes the logits of all K + 1 positions. ``accept`` then draws the target token of
each position exactly as a decode step would (the same ``Sampler`` over that position's logits
with the request's own ``SamplerState``: greedy argmax, or the seeded generator at that output
index, with penalties and ``logit_bias`` seeing the tokens accepted before it), appends it through
``token_delta`` (stop checks, ``max_tokens``, EOS, ``stop_token_ids``), and goes on only while the
token equals the draft. So the tokens emitted are the ones decoding without drafts would give; a
step emits between 1 and K + 1 of them. ``rollback`` gives back the pages that only held
rejected positions (the radix cache sees ``all_ids[:kv_len]`` only, never a rejected token).

Drafting is skipped, fail safe, for a row whose extra pages are not free without evicting the
radix cache (the step then decodes it as usual), for structured-output rows (the grammar
matcher cannot yet be rolled back) and on SWA pools.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from cache.kv_manager import KVManager, truncate
from configs.scheduler import SchedulerConfig
from engine.request import Request
from engine.sampling import Sampler
from engine.spec.ngram import NgramIndex
from transfer.wire.protocol import TokenDelta

EmitToken = Callable[[Request, int, "float | None", "list | None"], TokenDelta]


class NgramSpeculator:
    """Per-request n-gram drafts and their verification; one per scheduler (single thread).

    Counters: ``draft_tokens`` (draft tokens verified) and ``accepted_tokens`` (of those, accepted).
    """

    def __init__(self, kv: KVManager, k: int, n_min: int, n_max: int, max_model_len: int) -> None:
        self.kv = kv
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self.max_model_len = max_model_len
        self.draft_tokens = 0
        self.accepted_tokens = 0
        # a request's index lives as long as the request (no registry to clean up)
        self._index: weakref.WeakKeyDictionary[Request, NgramIndex] = weakref.WeakKeyDictionary()

    def _indexed(self, req: Request) -> NgramIndex:
        """``req``'s index, fed with the tokens it gained since the last call."""
        ix = self._index.get(req)
        if ix is None:
            ix = self._index[req] = NgramIndex(self.n_min, self.n_max)
        n_prompt = len(req.prompt_ids)
        if len(ix) < n_prompt:
            ix.extend(req.prompt_ids[len(ix) :])
        ix.extend(req.output_ids[len(ix) - n_prompt :])
        return ix

    def draft(self, req: Request) -> list[int]:
        """Draft tokens for ``req``'s next step, with pages for them taken (``[]``: decode as usual).

        At most ``k``, never past ``max_tokens`` or the context; ``req`` must hold the pages of
        position ``kv_len`` already (``RunningBatch.prepare_decode``)."""
        if self.kv.has_swa or req.sampler_state.matcher is not None:
            return []
        k = min(self.k, req.remaining_new_tokens() - 1, self.max_model_len - req.seq_len - 1)
        if k <= 0:
            return []
        d = self._indexed(req).propose(k)
        if not d:
            return []
        end = req.kv_len + 1 + len(d)
        need = self.kv.prompt_demand(req.kv, end).full
        if need > self.kv.allocator.num_free() or not self.kv.ensure_pages(req.kv, end):
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
                if hit and not req.finished:
                    still.append(a)
            active, j = still, j + 1
        for (req, d, _), m, acc in zip(rows, emitted, accepted):
            self.draft_tokens += len(d)
            self.accepted_tokens += acc
            req.kv_len += m
            truncate(self.kv, req.kv, req.kv_len)
        return out


def speculator_for(cfg: SchedulerConfig, kv: KVManager, max_model_len: int) -> NgramSpeculator | None:
    """The speculator ``cfg.speculative_method`` asks for, or None (off: the plain decode path)."""
    if cfg.speculative_method != "ngram":
        return None
    return NgramSpeculator(kv, cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max, max_model_len)
