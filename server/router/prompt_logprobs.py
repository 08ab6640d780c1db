"""The ``prompt_logprobs`` field of a response (vLLM's shape): per prompt token, ``None`` for the
first, else ``{token_id: {"logprob", "rank", "decoded_token"}}`` with the prompt token itself and
the top alternatives the request asked for (JSON object keys are the ids written as strings)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer


def prompt_logprobs_json(tokenizer: Tokenizer, run) -> list[dict | None] | None:
    """``run``'s (a ``ChoiceRun``) prompt logprobs as vLLM returns them, or None when the worker
    sent none."""
    entries = run.prompt_logprobs
    if entries is None:
        return None
    out: list[dict | None] = []
    for tid, e in zip(run.session.prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        lp, top, rank = e
        d = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([tid])}}
        for r, (i, v) in enumerate(top, start=1):
            d.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": tokenizer.decode([i])})
        out.append(d)
    return out
