"""``POST /v1/completions``: prompts (text, texts, token ids) to text, OpenAI completions shapes."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from engine.tokenizer import Tokenizer
from server.router.choices import ChoiceRun, Piece
from server.router.common import (
    check_common,
    check_max_tokens,
    new_runs,
    now_s,
    response_id,
    sampling_params,
    stream_usage,
    token_label,
    truncate_prompt,
    usage,
)
from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import parse_model
from server.router.openai_schemas import CompletionRequest
from server.router.parallel import best, check_n
from server.router.prompt_logprobs import prompt_logprobs_json
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
    if req.echo and req.max_tokens == 0:  # the prompt alone (lm-eval's loglikelihood): one token is generated, dropped
        return
    check_max_tokens(req.max_tokens, "max_tokens")


async def create_completion(ctx: RouterContext, request: Request, body: dict) -> Response:
    """Handle one completions request (its body read and parsed as a JSON object); raises ``APIError`` on refusal."""
    arrival = time.monotonic()
    req = parse_model(CompletionRequest, body)
    check_common(ctx, req)
    _check(req)
    params = sampling_params(req, 1 if req.max_tokens == 0 else req.max_tokens, req.logprobs)
    n, gen = check_n(req.n, req.best_of, req.stream)
    prompts = tokenize_prompts(ctx.tokenizer, req.prompt, req.add_special_tokens)
    runs = [
        r
        for p, (ids, text) in enumerate(prompts)
        for r in new_runs(
            ctx,
            p * gen,
            gen,
            truncate_prompt(ctx, ids, req),
            params,
            req,
            req.max_tokens is None,
            arrival,
            text,
            ranked=gen > n,
        )
    ]
    return await serve_choices(
        ctx, request, runs, req.stream, CompletionFormat(ctx, req), stream_usage(req)[0], priority=req.priority
    )


class CompletionFormat:
    """OpenAI completions response and ``text_completion`` chunks (see ``serving.ResponseFormat``)."""

    def __init__(self, ctx: RouterContext, req: CompletionRequest) -> None:
        self.ctx, self.req = ctx, req
        self.id, self.created = response_id("cmpl", req.request_id), now_s()
        self._offsets: dict[int, int] = {}
        self._echo_logprobs = req.echo and req.logprobs is not None  # the echoed prompt's tokens lead the logprobs

    def _prompt_entries(self, run: ChoiceRun, then=((), (), ())) -> tuple[list, list, list]:
        """(ids, logprobs, top (id, logprob) lists) of the prompt's tokens, then of ``then``'s."""
        entries = run.prompt_logprobs or [None] * len(run.session.prompt_ids)
        k = self.req.logprobs or 0
        lps = [e[0] if e else None for e in entries]
        tops = [e[1][:k] if e else None for e in entries]
        return ([*run.session.prompt_ids, *then[0]], [*lps, *then[1]], [*tops, *then[2]])

    def _base(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }

    def _logprobs(self, run: ChoiceRun, ids, logprobs, tops, start: int | None = None) -> dict | None:
        """The OpenAI logprobs object of ``ids``; text offsets continue from the last call's for
        this choice (from ``start``, else after the echoed prompt)."""
        if self.req.logprobs is None:
            return None
        tok, as_ids = self.ctx.tokenizer, self.req.return_tokens_as_token_ids
        texts = [tok.decode([i]) for i in ids]
        pos = start if start is not None else len(run.prompt_text or "") if self.req.echo else 0
        offsets, pos = [], self._offsets.get(run.index, pos)
        for t in texts:
            offsets.append(pos)
            pos += len(t)
        self._offsets[run.index] = pos
        top = []
        for tid, lp, alts in zip(ids, logprobs, tops):
            if lp is None:  # the prompt's first token: nothing before it to score it
                top.append(None)
                continue
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
        return [r for p in range(len(runs) // gen) for r in best(runs[p * gen : (p + 1) * gen], n, p * n)]

    def full(self, runs: list[ChoiceRun]) -> dict:
        """The complete response: ``n`` choices per prompt; ``usage`` over every sequence generated
        (with ``best_of``, the ones not returned too)."""
        choices = []
        for r in self._kept(runs):
            ids, lps, tops = r.token_ids, r.logprobs, r.top_logprobs
            if self._echo_logprobs:
                ids, lps, tops = self._prompt_entries(r, (ids, lps, tops))
            c = {
                "index": r.index,
                "text": (r.prompt_text if self.req.echo else "") + r.text,
                "logprobs": self._logprobs(r, ids, lps, tops, start=0 if self._echo_logprobs else None),
                "finish_reason": r.finish_reason,
            }
            if self.req.return_token_ids:
                c.update(prompt_token_ids=r.session.prompt_ids, token_ids=r.token_ids)
            if self.req.prompt_logprobs is not None:
                c["prompt_logprobs"] = prompt_logprobs_json(self.ctx.tokenizer, r)
            choices.append(c)
        return {**self._base(choices), "usage": usage(runs)}

    def opening(self, runs: list[ChoiceRun]) -> list[dict]:
        """Echoed prompt text and/or prompt token ids, one chunk per choice, if asked for."""
        if not (self.req.echo or self.req.return_token_ids or self.req.prompt_logprobs is not None):
            return []
        out = []
        for r in runs:
            lps = self._logprobs(r, *self._prompt_entries(r), start=0) if self._echo_logprobs else None
            c = {
                "index": r.index,
                "text": r.prompt_text if self.req.echo else "",
                "logprobs": lps,
                "finish_reason": None,
            }
            if self.req.return_token_ids:
                c["prompt_token_ids"] = r.session.prompt_ids
            if self.req.prompt_logprobs is not None:
                c["prompt_logprobs"] = prompt_logprobs_json(self.ctx.tokenizer, r)
            out.append(self._base([c]))
        return out

    def chunks(self, run: ChoiceRun, piece: Piece) -> list[dict]:
        """One chunk per piece that carries text, a finish reason, or tokens the client asked to see."""
        wants_tokens = self.req.logprobs is not None or self.req.return_token_ids
        if not (piece.text or piece.finish_reason or (wants_tokens and piece.ids)):
            return []
        c = {
            "index": run.index,
            "text": piece.text,
            "logprobs": self._logprobs(run, piece.ids, piece.logprobs, piece.top_logprobs),
            "finish_reason": piece.finish_reason,
        }
        if self.req.return_token_ids:
            c["token_ids"] = piece.ids
        return [self._base([c])]

    def closing(self, runs: list[ChoiceRun]) -> list[dict]:
        """The usage chunk when ``stream_options.include_usage``."""
        if not stream_usage(self.req)[1]:
            return []
        return [{**self._base([]), "usage": usage(runs)}]
