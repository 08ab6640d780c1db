"""``POST /v1/completions``: prompts (text, texts, token ids) to text, OpenAI completions shapes."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from engine.tokenizer import Tokenizer
from server.router.choices import ChoiceRun, Piece
from server.router.common import (check_common, check_max_tokens, new_runs, now_s, response_id, sampling_params,
                                  stream_usage, token_label, truncate_prompt, usage)
from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import parse_model
from server.router.openai_schemas import CompletionRequest
from server.router.parallel import best, check_n
from server.router.serving import serve_choices


def tokenize_prompts(tok: Tokenizer, prompt, add_special_tokens: bool = True) -> list[tuple[list[int], str]]:
    """``(token ids, text)`` per prompt; 400 ``APIError`` for empty prompts or ids out of the vocabulary.
    Text prompts get the model's BOS when it wants one, unless ``add_special_tokens`` is False."""
    if isinstance(prompt, str):
        items = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    elif isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for p in items:
        if isinstance(p, str):
            out.append((tok.encode(p, add_special_tokens=add_special_tokens), p))  # BOS if the model wants one
            continue
        bad = [t for t in p if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {tok.vocab_size}); got {bad[:5]}", param="prompt")
        out.append((list(p), tok.decode(p)))
    return out


def _check(req: CompletionRequest) -> None:
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")


async def create_completion(ctx: RouterContext, request: Request, body: bytes) -> Response:
    """Handle one completions request (body already read); raises ``APIError`` on refusal."""
    arrival = time.monotonic()
    req = parse_model(CompletionRequest, body)
    check_common(ctx, req)
    _check(req)
    params = sampling_params(req, req.max_tokens, req.logprobs)
    n, gen = check_n(req.n, req.best_of, req.stream)
    prompts = tokenize_prompts(ctx.tokenizer, req.prompt, req.add_special_tokens)
    runs = [r for p, (ids, text) in enumerate(prompts)
            for r in new_runs(ctx, p * gen, gen, truncate_prompt(ctx, ids, req), params, req, req.max_tokens is None,
                              arrival, text, ranked=gen > n)]
    return await serve_choices(ctx, request, runs, req.stream, CompletionFormat(ctx, req), stream_usage(req)[0],
                              priority=req.priority)


class CompletionFormat:
    """OpenAI completions response and ``text_completion`` chunks (see ``serving.ResponseFormat``)."""

    def __init__(self, ctx: RouterContext, req: CompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        self.id, self.created = response_id("cmpl", req.request_id), now_s()
        self._offsets: dict[int, int] = {}

    def _base(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name,
                "choices": choices}

    def _logprobs(self, run: ChoiceRun, ids, logprobs, tops) -> dict | None:
        if self.req.logprobs is None:
            return None
        tok, as_ids = self.ctx.tokenizer, self.req.return_tokens_as_token_ids
        texts = [tok.decode([i]) for i in ids]
        offsets, pos = [], self._offsets.get(run.index, len(run.prompt_text or "") if self.req.echo else 0)
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        self._offsets[run.index] = pos
        top = []
        for tid, lp, alts in zip(ids, logprobs, tops):
            entry = {token_label(tok, tid, as_ids): lp}  # vLLM: the sampled token first, then the top ones
            for i, v in alts or []:
                entry.setdefault(token_label(tok, i, as_ids), v)
            top.append(entry)
        labels = texts if not as_ids else [token_label(tok, i, True) for i in ids]
        return {"tokens": labels, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}

    def _kept(self, runs: list[ChoiceRun]) -> list[ChoiceRun]:
        """The choices returned: all of them, or with ``best_of`` > ``n`` the best ``n`` of each
        prompt's ``best_of`` (by cumulative logprob), indexed ``prompt * n + i``."""
        n, gen = self.req.n or 1, self.req.best_of or self.req.n or 1
        if gen == n:
            return runs
        return [r for p in range(len(runs) // gen) for r in best(runs[p * gen:(p + 1) * gen], n, p * n)]

    def full(self, runs: list[ChoiceRun]) -> dict:
        """The complete response: ``n`` choices per prompt; ``usage`` over every sequence generated
        (with ``best_of``, the ones not returned too)."""
        choices = []
        for r in self._kept(runs):
            c = {"index": r.index, "text": (r.prompt_text if self.req.echo else "") + r.text,
                 "logprobs": self._logprobs(r, r.token_ids, r.logprobs, r.top_logprobs),
                 "finish_reason": r.finish_reason}
            if self.req.return_token_ids:
                c.update(prompt_token_ids=r.session.prompt_ids, token_ids=r.token_ids)
            choices.append(c)
        return {**self._base(choices), "usage": usage(runs)}

    def opening(self, runs: list[ChoiceRun]) -> list[dict]:
        """Echoed prompt text and/or prompt token ids, one chunk per choice, if asked for."""
        if not (self.req.echo or self.req.return_token_ids):
            return []
        out = []
        for r in runs:
            c = {"index": r.index, "text": r.prompt_text if self.req.echo else "", "logprobs": None,
                 "finish_reason": None}
            if self.req.return_token_ids:
                c["prompt_token_ids"] = r.session.prompt_ids
            out.append(self._base([c]))
        return out

    def chunks(self, run: ChoiceRun, piece: Piece) -> list[dict]:
        """One chunk per piece that carries text, a finish reason, or tokens the client asked to see."""
        wants_tokens = self.req.logprobs is not None or self.req.return_token_ids
        if not (piece.text or piece.finish_reason or (wants_tokens and piece.ids)):
            return []
        c = {"index": run.index, "text": piece.text,
             "logprobs": self._logprobs(run, piece.ids, piece.logprobs, piece.top_logprobs),
             "finish_reason": piece.finish_reason}
        if self.req.return_token_ids:
            c["token_ids"] = piece.ids
        return [self._base([c])]

    def closing(self, runs: list[ChoiceRun]) -> list[dict]:
        """The usage chunk when ``stream_options.include_usage``."""
        if not stream_usage(self.req)[1]:
            return []
        return [{**self._base([]), "usage": usage(runs)}]
