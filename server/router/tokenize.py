"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes it) or ``messages``
(rendered with the chat template as ``/v1/chat/completions`` renders them) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``: the vocabulary's strings,
only with ``return_token_strs``). ``/detokenize`` answers ``{"prompt": text}`` (special tokens
kept). Both need the API key when one is configured; ``/version`` is open.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from server.router.chat import render_text
from server.router.common import served_max_model_len
from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import check_api_key, parse_model, parse_object, read_body
from server.router.openai_schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest


def _check_model(ctx: RouterContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def tokenize(ctx: RouterContext, body: bytes) -> dict:
    """The ``/tokenize`` answer for a JSON body; raises ``APIError`` (400/404) on bad input."""
    data = parse_object(body)
    req = parse_model(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
    _check_model(ctx, req.model)
    tok = ctx.tokenizer
    text = render_text(ctx, req) if isinstance(req, TokenizeChatRequest) else req.prompt
    ids = tok.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": served_max_model_len(ctx), "tokens": ids, "token_strs": strs}


def detokenize(ctx: RouterContext, body: bytes) -> dict:
    """The ``/detokenize`` answer; 400 for ids outside the vocabulary."""
    req = parse_model(DetokenizeRequest, body)
    _check_model(ctx, req.model)
    bad = [t for t in req.tokens if not 0 <= t < ctx.tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"tokens must be in [0, {ctx.tokenizer.vocab_size}); got {bad[:5]}", param="tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


def add_tokenize_routes(app: FastAPI, ctx: RouterContext, version: str) -> None:
    """Register ``/tokenize``, ``/detokenize`` and ``/version`` on ``app``."""

    async def run(request: Request, handler) -> JSONResponse:
        try:
            check_api_key(request, ctx.cfg.server.api_key)
            body = await read_body(request, ctx.cfg.server.max_body_bytes)
            return JSONResponse(handler(ctx, body))
        except APIError as e:
            return e.response()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        """Token ids of a prompt or of chat messages (vLLM's ``/tokenize``)."""
        return await run(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        """Text of token ids (vLLM's ``/detokenize``)."""
        return await run(request, detokenize)

    @app.get("/version")
    async def version_route() -> JSONResponse:
        """``{"version": <pdserve version>}``."""
        return JSONResponse({"version": version})
