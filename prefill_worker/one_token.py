"""One-token requests answered by the prefill worker itself (``PrefillRequest.answer_router``).

A request that generates one token (``max_new_tokens`` 1: lm-eval's scoring pattern, ``echo`` with
``max_tokens`` 0) is finished when its prompt is: the prefill worker samples that token anyway. The
router sends such a PD request to the prefill worker alone, and the prefill worker answers it with
the ``TokenDelta`` a colocated worker would send: the token (its logprobs, the prompt logprobs),
finished "length", or "stop" on an EOS or stop token. No decode worker reserves pages, no KV is
written, nothing waits for a destination: the hand-off (destination, write, landing, the decode
worker's delta) leaves the request's latency altogether. The prompt's KV goes to this worker's radix
cache as after a write.

Invariant: a direct job never has a destination, a manifest or a write; it ends in the step that
computes its last chunk (or as any job does: aborted, handed back on a role switch).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.scheduler.base import Outcome
from engine.scheduler.executor import as_stop_token
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import PrefillRequest, TokenDelta
from transfer.wire.sampling_params import FinishReason

#: Why a ``PrefillRequest`` that asks for a direct answer was refused.
NOT_ONE_TOKEN = "answer_router is for a request's first prefill (generation 0) with max_new_tokens 1"


def direct_refusal(msg: PrefillRequest) -> str | None:
    """Why ``msg`` may not be answered directly (None: it may, or it does not ask to)."""
    if not msg.answer_router:
        return None
    if msg.generation != 0 or msg.params.max_new_tokens != 1:
        return f"{NOT_ONE_TOKEN}; got generation {msg.generation}, max_new_tokens {msg.params.max_new_tokens}"
    return None


def final_delta(delta: TokenDelta, eos_token_ids: Sequence[int], ignore_eos: bool) -> TokenDelta:
    """``delta``, the first token's delta of a prefill step (sampled without EOS checks: a decode
    worker usually makes them), as the request's last: an EOS token ends it "stop" (the token moves
    to ``stop_token_id``, ``engine.scheduler.executor.as_stop_token``), any other token ends it
    "length" unless a stop token already ended it."""
    tok = delta.token_ids[0] if delta.token_ids else None
    if tok is not None and not ignore_eos and tok in eos_token_ids:
        as_stop_token(delta).finish_reason = FinishReason.STOP
    elif delta.finish_reason is None:
        delta.finish_reason = FinishReason.LENGTH
    return delta


def answer(s, job, delta: TokenDelta) -> Outbox:
    """End direct ``job`` of prefill scheduler ``s`` in the step that computed its prompt: its token
    to the router as the request's last delta (``final_delta``), its KV to the radix cache."""
    delta = final_delta(delta, s.eos_token_ids, job.req.params.ignore_eos)
    s.stats.generation_tokens += 1
    s.stats.direct_answers += 1
    out = s.finish(job, Outcome(delta.finish_reason))
    out.token(job.req.owner, delta)
    return out
