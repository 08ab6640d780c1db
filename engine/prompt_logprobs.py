"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

``prompt_rows(req, start, length)`` says how many of a prefill chunk's new tokens need their
logits (every position whose next token is still a prompt token); ``score(logits, targets, k)``
turns those rows into ``(logprob, top k (id, logprob), rank)`` entries, vLLM's semantics: the raw
distribution (fp32 ``log_softmax`` of the unprocessed logits), rank 1 for the most likely token.
A request's entries accumulate in ``Request.prompt_logprobs`` (``None`` first: the first token has
no context) and go out with its first token.
"""

from __future__ import annotations

import torch

from engine.request import Request


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether ``req``'s prefill must compute prompt logprobs: asked for, and the first prefill
    (a recompute after a retract, with output tokens already, does not send them again)."""
    return req.params.prompt_logprobs is not None and not req.output_ids


def prompt_rows(req: Request, start: int, length: int) -> int:
    """How many leading tokens of the chunk ``[start, start + length)`` of ``req``'s prompt need
    logits: positions ``q < len(prompt) - 1`` (position q scores prompt token q + 1). 0 when
    ``req`` does not want prompt logprobs or its chunk does not start where the last one ended."""
    if not wants_prompt_logprobs(req):
        return 0
    have = len(req.prompt_logprobs) if req.prompt_logprobs is not None else 0
    if start != max(have - 1, 0):
        return 0
    return max(0, min(start + length, len(req.prompt_ids) - 1) - start)


def score(logits: torch.Tensor, targets: list[int], k: int) -> list[tuple[float, list[tuple[int, float]], int]]:
    """``(logprob of targets[i], top-k (id, logprob) pairs, rank of targets[i])`` for each row i of
    ``logits`` ``[len(targets), vocab]``."""
    lp = logits.to(torch.float32).log_softmax(dim=-1)
    tgt = torch.as_tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    chosen = lp.gather(1, tgt)
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if k > 0:
        vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in targets]
    return list(zip(chosen, tops, ranks))


def record(req: Request, start: int, logits: torch.Tensor) -> None:
    """Append the entries scored by ``logits`` (rows for positions ``start ..``) to
    ``req.prompt_logprobs`` (started with ``None`` for the first token)."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    n = logits.shape[0]
    targets = req.prompt_ids[start + 1 : start + 1 + n]
    req.prompt_logprobs.extend(score(logits, targets, req.params.prompt_logprobs))
