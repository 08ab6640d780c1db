"""Runs extend and decode batches for a scheduler: forward, sample, append, stop checks.

Shared by the colocated, prefill and decode workers so every mode samples and finishes requests
the same way.
"""
from __future__ import annotations

from engine.forward_batch import ForwardMode
from engine.model_runner import ModelRunner, SeqChunk
from engine.request import ReqStatus, Request
from engine.sampling import Sampler, check_stop
from engine.scheduler.admission import ExtendItem
from engine.scheduler.events import TokenEvent


class BatchExecutor:
    def __init__(self, runner: ModelRunner, eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.sampler = Sampler()
        self.eos = frozenset(eos_token_ids)

    def extend(self, items: list[ExtendItem]) -> list[tuple[Request, TokenEvent]]:
        """Compute the items' tokens; requests whose prompt completes get their next token."""
        seqs = [SeqChunk(i.req.all_ids[i.req.kv_len:i.req.kv_len + i.length], i.req.kv_len, i.req.pages)
                for i in items]
        logits = self.runner.forward(ForwardMode.EXTEND, seqs)
        done = [k for k, i in enumerate(items) if i.completes]
        for i in items:
            i.req.kv_len += i.length
        for k in done:
            items[k].req.status = ReqStatus.RUNNING
        return self._sample(logits[done] if len(done) < len(items) else logits, [items[k].req for k in done])

    def decode(self, reqs: list[Request]) -> list[tuple[Request, TokenEvent]]:
        """One token for each request; pages for position ``kv_len`` must already be allocated."""
        seqs = [SeqChunk([r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]], r.kv_len, r.pages) for r in reqs]
        logits = self.runner.forward(ForwardMode.DECODE, seqs)
        for r in reqs:
            r.kv_len += 1
        return self._sample(logits, reqs)

    def _sample(self, logits, reqs: list[Request]) -> list[tuple[Request, TokenEvent]]:
        if not reqs:
            return []
        out = self.sampler.sample(logits, [r.params for r in reqs], [r.sampler_state for r in reqs])
        events = []
        for k, r in enumerate(reqs):
            tok = out.token_ids[k]
            r.sampler_state.append(tok)
            r.output_ids.append(tok)
            ev = TokenEvent(r.rid, [tok], [out.logprobs[k]], [out.top_logprobs[k]],
                            prompt_tokens=len(r.prompt_ids), cached_tokens=r.cached_tokens)
            reason = check_stop(tok, r.params, self.eos, len(r.output_ids))
            if reason is None and r.seq_len >= self.runner.max_model_len:
                reason = "length"
            if reason is not None:
                r.finish(reason)
                ev.finish_reason = reason
                if reason == "stop":  # the EOS / stop token itself is not part of the output
                    ev.token_ids, ev.logprobs, ev.top_logprobs = [], [], []
            events.append((r, ev))
        return events
