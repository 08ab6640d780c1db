"""Checks and pieces shared by the completions and chat endpoints."""

from __future__ import annotations

import time
import uuid

from pydantic import ValidationError

from server.router.choices import ChoiceRun
from server.router.context import RouterContext
from server.router.errors import APIError, from_validation_error
from server.router.extensions import check_extensions
from server.router.failover import FailoverBudget
from server.router.openai_schemas import SamplingFields
from server.router.parallel import choice_params
from server.router.session import GenerationSession
from server.router.structured import structured_output
from transfer.wire.sampling_params import SamplingParams


def check_common(ctx: RouterContext, req: SamplingFields) -> None:
    """400/404 ``APIError`` for a wrong model name or options this server does not implement."""
    if req.model is not None and req.model != ctx.model_name:
        raise APIError(
            404,
            f"model {req.model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )
    check_logit_bias(req.logit_bias, ctx.tokenizer.vocab_size)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed together with stream=true", param="stream_options")
    check_extensions(req)


def served_max_model_len(ctx: RouterContext) -> int | None:
    """The smallest ``max_model_len`` the workers reported (None before any heartbeat)."""
    return min((h.stats.max_model_len for h in ctx.registry.handles.values() if h.stats), default=None)


def truncate_prompt(ctx: RouterContext, ids: list[int], req: SamplingFields) -> list[int]:
    """``ids`` cut to ``truncate_prompt_tokens`` (vLLM): the last k tokens (``truncation_side``
    "left", the default) or the first k ("right"); -1 means the served ``max_model_len``."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0:
        raise APIError(
            400, "truncate_prompt_tokens must be -1 (the context length) or >= 1, got 0", param="truncate_prompt_tokens"
        )
    if k == -1:
        k = served_max_model_len(ctx)
        if k is None:
            return ids
    if len(ids) <= k:
        return ids
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


def stream_usage(req: SamplingFields) -> tuple[bool, bool]:
    """(usage in every chunk, a final usage chunk) as ``stream_options`` asks."""
    opts = req.stream_options
    return (False, False) if opts is None else (opts.usage_every_chunk, opts.final_usage)


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """400 ``APIError`` unless every ``logit_bias`` key is a token id in ``[0, vocab_size)``
    (biases themselves are checked by ``SamplingParams``)."""
    for key in bias or {}:
        if not key.strip().isdigit() or int(key) >= vocab_size:
            raise APIError(
                400,
                f"logit_bias keys must be token ids in [0, {vocab_size}) written as strings, got {key!r}",
                param="logit_bias",
            )


def check_max_tokens(value: int | None, name: str) -> None:
    """400 ``APIError`` if an explicit ``max_tokens`` is below 1."""
    if value is not None and value < 1:
        raise APIError(400, f"{name} must be >= 1, got {value}", param=name)


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, max_tokens_name: str = "max_tokens"
) -> SamplingParams:
    """Engine params for ``req``; ``max_tokens`` None validates as 1 and the session later sets the
    room the route leaves (see ``auto_max_tokens``)."""
    try:
        params = req.sampling_params(max_tokens if max_tokens is not None else 1, logprobs)
    except ValidationError as e:
        raise from_validation_error(e, {"max_new_tokens": max_tokens_name}) from None
    so = structured_output(req)
    return params if so is None else params.model_copy(update={"structured": so})


def new_runs(
    ctx: RouterContext,
    first_index: int,
    count: int,
    prompt_ids: list[int],
    params: SamplingParams,
    req: SamplingFields,
    auto_max_tokens: bool,
    arrival: float,
    prompt_text: str | None = None,
    ranked: bool = False,
) -> list[ChoiceRun]:
    """``count`` choices of one prompt, indexed from ``first_index``: the first leads, the others
    follow it (same route, sent after its first token) with their own seeds (``parallel.choice_params``;
    ``ranked``: best_of, the sampled tokens' logprobs are asked for)."""
    runs: list[ChoiceRun] = []
    for i in range(count):
        leader = runs[0] if runs else None
        p = choice_params(params, i, ranked)
        if leader is not None and p.prompt_logprobs is not None:  # the leader's prompt logprobs serve all
            p = p.model_copy(update={"prompt_logprobs": None})
        runs.append(
            new_run(ctx, first_index + i, prompt_ids, p, req, auto_max_tokens, arrival, prompt_text, follows=leader)
        )
    return runs


def new_run(
    ctx: RouterContext,
    index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    req: SamplingFields,
    auto_max_tokens: bool,
    arrival: float,
    prompt_text: str | None = None,
    follows: ChoiceRun | None = None,
) -> ChoiceRun:
    """A ``ChoiceRun`` over a fresh ``GenerationSession`` for one prompt (``follows``: its leader,
    ``ChoiceRun``). Completions with ``echo`` and ``max_tokens`` 0 generate one token and drop it."""
    timeout_s = ctx.cfg.server.request_timeout_s
    if req.timeout is not None:
        timeout_s = min(timeout_s, req.timeout)
    session = GenerationSession(
        ctx.registry,
        ctx.table,
        prompt_ids,
        params,
        timeout_s=timeout_s,
        auto_max_tokens=auto_max_tokens,
        arrival=arrival,
        retries=ctx.cfg.cluster.fresh_pair_retries,
        on_retry=ctx.metrics.retries.inc,
        on_move=ctx.metrics.queued_moves.inc,
        on_hand_back=ctx.metrics.handbacks.inc,
        failover=FailoverBudget(
            ctx.cfg.cluster.max_failovers,
            on_outcome=lambda worker, outcome: ctx.metrics.failovers.labels(worker, outcome).inc(),
            on_recomputed=ctx.metrics.failover_recomputed.inc,
            on_same_prefill=ctx.metrics.failover_same_prefill.inc,
            on_stall=ctx.metrics.failover_stall.observe,
        ),
    )
    prompt_only = getattr(req, "echo", False) and getattr(req, "max_tokens", None) == 0
    return ChoiceRun(
        index,
        session,
        ctx.tokenizer,
        req.stop_strings(),
        req.skip_special_tokens,
        prompt_text,
        include_stop=req.include_stop_str_in_output,
        follows=follows,
        keep_output=not prompt_only,
    )


def usage(runs: list[ChoiceRun]) -> dict:
    """OpenAI ``usage`` over all choices: completion tokens of every choice, prompt tokens (and
    cached prompt tokens, in ``prompt_tokens_details``) once per prompt however many choices it has."""
    leaders = [r for r in runs if r.leads]
    prompt = sum(len(r.session.prompt_ids) for r in leaders)
    completion = sum(len(r.token_ids) for r in runs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in leaders)},
    }


def response_id(prefix: str, request_id: str | None = None) -> str:
    """The response id: ``<prefix>-<request_id>`` when the client sent one (vLLM), else
    ``<prefix>-<random hex>``."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def token_label(tokenizer, token_id: int, as_ids: bool | None) -> str:
    """A token as logprobs show it: its text, or ``token_id:<id>`` with ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def now_s() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())
