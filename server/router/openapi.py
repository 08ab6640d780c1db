"""The router's OpenAPI document (``GET /openapi.json``), built from the same pydantic models the
endpoints validate with, so clients, codegen and the schemathesis fuzz suite see what is enforced.

The generation routes read their bodies themselves (bounded size, OpenAI-shaped 400s), so FastAPI
cannot infer their schemas; this module states them.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from server.router.admin import DrainAnswer, DrainBody, RoleAnswer, RoleBody
from server.router.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

_ERROR = {
    "description": "OpenAI-shaped error: {error: {message, type, param, code}}",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}
_BEARER = "apiKey"
_SECURITY_SCHEMES = {
    _BEARER: {"type": "http", "scheme": "bearer", "description": "One of the router's --api-key values"}
}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _generation(ref: str, summary: str) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}
    ok = {
        "description": "The completion (JSON), or with stream=true an SSE stream of chunks",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": body,
            "responses": {"200": ok, "400": _ERROR, "401": _ERROR, "404": _ERROR, "413": _ERROR, "503": _ERROR},
        }
    }


def _utility(schema: dict, summary: str) -> dict:
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    ok = {"description": summary, "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": body,
            "responses": {"200": ok, "400": _ERROR, "401": _ERROR, "404": _ERROR, "413": _ERROR},
        }
    }


def _error(description: str) -> dict:
    return {**_ERROR, "description": f"{description}; OpenAI-shaped error body"}


def _drain(body_ref: str, answer_ref: str) -> dict:
    """``POST /admin/drain`` (server.router.admin): API key required when the router has one."""
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": body_ref}}}}
    accepted = {
        "description": "The worker left rotation and was told to drain; it finishes what it holds and exits 0",
        "content": {"application/json": {"schema": {"$ref": answer_ref}}},
    }
    return {
        "post": {
            "summary": "Take a worker out of rotation and drain it",
            "description": "The router stops routing new requests to the named worker at once and sends it "
            "Drain. Needs 'Authorization: Bearer <key>' when the router runs with --api-key "
            "(without one the route is open like /v1/*).",
            "security": [{_BEARER: []}],
            "requestBody": body,
            "responses": {
                "202": accepted,
                "400": _error("Body is not a JSON object with worker_id"),
                "401": _error("Missing or wrong API key"),
                "404": _error("No worker by that id; the message lists the known workers"),
                "409": _error("The worker is not serving (drained, down or restarting); a draining one is asked again"),
                "413": _error("Body larger than --max-body-bytes"),
            },
        }
    }


def _role(body_ref: str, answer_ref: str) -> dict:
    """``POST /admin/role`` (server.router.admin): API key required when the router has one."""
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": body_ref}}}}
    done = {
        "description": "The worker moved out or finished what it held and serves in its new role",
        "content": {"application/json": {"schema": {"$ref": answer_ref}}},
    }
    return {
        "post": {
            "summary": "Switch a PD worker between prefill and decode, its weights kept loaded",
            "description": "The worker leaves rotation, a decode worker migrates its requests to peer decode "
            "workers, a prefill worker finishes its prompt writes; then it serves in the new role. Needs "
            "'Authorization: Bearer <key>' when the router runs with --api-key.",
            "security": [{_BEARER: []}],
            "requestBody": body,
            "responses": {
                "200": done,
                "400": _error("Body is not a JSON object with worker and role"),
                "401": _error("Missing or wrong API key"),
                "404": _error("No worker by that id; the message lists the known workers"),
                "409": _error("Refused or not made: it would leave a role empty, the worker is not ready, ..."),
                "413": _error("Body larger than --max-body-bytes"),
            },
        }
    }


def _get(summary: str, codes: tuple[str, ...] = ("200",)) -> dict:
    return {"get": {"summary": summary, "responses": {c: {"description": summary} for c in codes}}}


def openapi_document(version: str) -> dict:
    """The OpenAPI 3.1 document of the public routes (the dashboard is left out)."""
    models = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        DetokenizeRequest,
        DrainBody,
        DrainAnswer,
        RoleBody,
        RoleAnswer,
    ]
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    tokenize_body = {
        "oneOf": [refs[(TokenizeCompletionRequest, "validation")], refs[(TokenizeChatRequest, "validation")]]
    }
    schemas = {**defs.get("$defs", {}), "ErrorResponse": _ERROR_SCHEMA}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": version},
        "paths": {
            "/v1/completions": _generation(refs[(CompletionRequest, "validation")]["$ref"], "Text completion"),
            "/v1/chat/completions": _generation(refs[(ChatCompletionRequest, "validation")]["$ref"], "Chat completion"),
            "/v1/models": _get("The served model"),
            "/tokenize": _utility(tokenize_body, "Token ids of a prompt or of chat messages (vLLM)"),
            "/detokenize": _utility(refs[(DetokenizeRequest, "validation")], "Text of token ids (vLLM)"),
            "/version": _get("The server's version (vLLM)"),
            "/health": _get("Readiness of every worker", ("200", "503")),
            "/metrics": _get("Prometheus text exposition"),
            "/admin/drain": _drain(refs[(DrainBody, "validation")]["$ref"], refs[(DrainAnswer, "validation")]["$ref"]),
            "/admin/role": _role(refs[(RoleBody, "validation")]["$ref"], refs[(RoleAnswer, "validation")]["$ref"]),
        },
        "components": {"schemas": schemas, "securitySchemes": _SECURITY_SCHEMES},
    }
