"""Runs extend and decode batches for a scheduler: forward, sample, append, stop checks.

Shared by the colocated, prefill and decode workers so every mode samples and finishes requests
the same way. Each sampled token yields one ``TokenDelta`` (empty ids when the token is the stop
token itself, which is not part of the output text: it travels in ``stop_token_id`` with its
logprobs, for usage and logprobs as vLLM counts them); a request that finished has ``finished`` set.
"""

from __future__ import annotations

from cache.kv_manager import KVManager
from engine.forward_batch import ForwardMode
from engine.model_runner import ModelRunner, SeqChunk
from engine.prompt_logprobs import prompt_rows, record
from engine.request import Phase, Request
from engine.sampling import Sampler
from engine.scheduler.admission import ExtendItem
from engine.spec.verify import NgramSpeculator
from transfer.wire.enums import FinishReason
from transfer.wire.protocol import TokenDelta
from transfer.wire.sampling_params import check_stop


def token_delta(
    req: Request, tok: int, logprob: float | None, top: list | None, eos: frozenset[int], max_model_len: int
) -> TokenDelta:
    """Append ``tok`` to ``req`` (output and sampler state), apply the stop checks (finishing
    ``req`` if one hits), and return the token's delta."""
    first = not req.output_ids
    req.sampler_state.append(tok)
    req.output_ids.append(tok)
    delta = TokenDelta(
        rid=req.rid,
        token_ids=[tok],
        logprobs=[logprob],
        top_logprobs=[top],
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
    )
    if first and req.prompt_logprobs is not None:  # they travel with the first token, once
        delta.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
    reason = check_stop(tok, req.params, eos, len(req.output_ids))
    if reason is None and req.seq_len >= max_model_len:
        reason = FinishReason.LENGTH
    if reason is not None:
        req.finish(reason)
        delta.finish_reason = reason
        if reason == FinishReason.STOP:
            as_stop_token(delta)
    return delta


def as_stop_token(delta: TokenDelta) -> TokenDelta:
    """``delta``'s one token moved to its stop token (``stop_token_id`` and its logprobs): a stop
    token is generated (ids, logprobs, usage) but not part of the output's text."""
    delta.stop_token_id, delta.stop_logprob, delta.stop_top_logprobs = (
        delta.token_ids[0],
        delta.logprobs[0],
        delta.top_logprobs[0],
    )
    delta.token_ids, delta.logprobs, delta.top_logprobs = [], [], []
    return delta


def verify_rows(verify: list[tuple[Request, list[int]]]) -> list[SeqChunk]:
    """The decode rows of drafting requests: ``[last token, d1 .. dK]`` of each, one token per row at
    positions ``kv_len ..``. Every row's K/V is stored before any row attends and each row attends up
    to its own position, so this is the causal verify of a small extend, run by the decode kernels
    (the C decode stack takes it): measured 1.09x a plain 8-row step for one row drafting 4 tokens,
    against 1.59x as a ragged extend row (``benchmarks/spec_step.py``)."""
    return [
        SeqChunk([t], r.kv_len + j, r.kv.pages, r.kv.swa_pages)
        for r, d in verify
        for j, t in enumerate([r.output_ids[-1], *d])
    ]


class BatchExecutor:
    """``kv``: the scheduler's KV manager; after every forward each request's SWA pages that
    left its window go back to the pool (``KVManager.release_window``). ``speculator``: decode rows
    it drafts for are verified in the same forward (``engine.spec.verify``) and may emit several
    tokens, one delta each; without it every decode row emits one token."""

    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids: tuple[int, ...],
        kv: KVManager | None = None,
        speculator: NgramSpeculator | None = None,
    ) -> None:
        self.runner = runner
        self.spec = speculator
        self.kv = kv
        self.sampler = Sampler()
        self.eos = frozenset(eos_token_ids)

    def _advance(self, req: Request, n: int) -> None:
        req.kv_len += n
        if self.kv is not None:
            self.kv.release_window(req.kv, req.kv_len)

    def extend(self, items: list[ExtendItem]) -> list[tuple[Request, TokenDelta]]:
        """Compute the items' tokens; requests whose prompt completes get their next token and
        become RUNNING (or FINISHED)."""
        return self.mixed([], items)[1]

    def decode(self, reqs: list[Request]) -> list[tuple[Request, TokenDelta]]:
        """One token for each request (with a speculator, one or more for a drafting one); pages for
        position ``kv_len`` must already be allocated."""
        return self.mixed(reqs, [])[0]

    def mixed(
        self, reqs: list[Request], items: list[ExtendItem]
    ) -> tuple[list[tuple[Request, TokenDelta]], list[tuple[Request, TokenDelta]]]:
        """One forward over decode rows ``reqs`` (first) and extend ``items``: ``(decode deltas,
        extend deltas)``, as ``decode(reqs)`` and ``extend(items)`` would give them apart. Either
        list may be empty (then the step is a plain DECODE or EXTEND one); both empty: no forward.
        With a speculator, the rows it drafts for become one decode row per verified position
        (``verify_rows``) after the plain decode rows, and their deltas (one per token emitted) follow
        the plain rows' in the decode deltas."""
        if not reqs and not items:  # e.g. a decode worker whose local prefill waits for pages, nothing running
            return [], []
        drafts = self.spec.drafts(reqs, sum(i.length for i in items)) if self.spec is not None else []
        verify = [(r, d) for r, d in zip(reqs, drafts) if d]
        if verify:  # plain rows first, then each drafting row's positions
            reqs = [r for r, d in zip(reqs, drafts) if not d]
        seqs = [
            SeqChunk([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]], r.kv_len, r.kv.pages, r.kv.swa_pages)
            for r in reqs
        ]
        seqs += verify_rows(verify)
        num_decode = len(seqs)
        seqs += [
            SeqChunk(
                i.req.all_ids[i.req.kv_len : i.req.kv_len + i.length],
                i.req.kv_len,
                i.req.kv.pages,
                i.req.kv.swa_pages,
                prompt_rows(i.req, i.req.kv_len, i.length),
            )
            for i in items
        ]
        mode = ForwardMode.MIXED if num_decode and items else (ForwardMode.DECODE if num_decode else ForwardMode.EXTEND)
        logits = self.runner.forward(mode, seqs, num_decode=num_decode)
        checked, at = [], len(reqs)
        for r, d in verify:  # a drafting row's K + 1 positions are consecutive one-token rows
            checked.append((r, d, logits[at : at + len(d) + 1]))
            at += len(d) + 1
        at = len(seqs)  # extra logit rows (prompt logprobs) follow the last-token rows
        for s, i in zip(seqs[num_decode:], items):
            if s.logit_rows:
                record(i.req, s.prefix_len, logits[at : at + s.logit_rows])
                at += s.logit_rows
        logits = logits[: len(seqs)]
        for r in reqs:
            self._advance(r, 1)
        done = [k for k, i in enumerate(items) if i.completes]
        for i in items:
            self._advance(i.req, i.length)
        for k in done:
            items[k].req.status = Phase.RUNNING
            items[k].req.mark("prefilled")
        rows = [*range(len(reqs)), *(num_decode + k for k in done)]
        out = self._sample(logits[rows] if len(rows) < len(seqs) else logits, [*reqs, *(items[k].req for k in done)])
        decoded = out[: len(reqs)]
        if checked:
            decoded += self.spec.accept(self.sampler, checked, self._emit)
        return decoded, out[len(reqs) :]

    def _emit(self, req: Request, tok: int, logprob: float | None, top: list | None) -> TokenDelta:
        return token_delta(req, tok, logprob, top, self.eos, self.runner.max_model_len)

    def _sample(self, logits, reqs: list[Request]) -> list[tuple[Request, TokenDelta]]:
        if not reqs:
            return []
        out = self.sampler.sample(logits, [r.params for r in reqs], [r.sampler_state for r in reqs])
        return [(r, self._emit(r, out.token_ids[k], out.logprobs[k], out.top_logprobs[k])) for k, r in enumerate(reqs)]
