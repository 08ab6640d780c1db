"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import re

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error to answer with: HTTP ``status``, a ``message`` for people, and OpenAI fields.

    ``type`` defaults from the status (400 -> invalid_request_error, ...); ``param`` names the
    offending request field when there is one; ``code`` is a short machine-readable reason;
    ``headers`` are sent with the response (e.g. ``Retry-After`` on a 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        """The JSON body of this error (also used as an SSE error event)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """A ``JSONResponse`` with this error's status and body."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


# loc parts that name a union member or validator, not a field (field names are snake_case)
_NOT_A_FIELD = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|union\[.*\]|[A-Z]\w*(\[.*\])?)$"
)


def _loc(loc: tuple, renames: dict[str, str]) -> str:
    parts = [str(p) for p in loc if not _NOT_A_FIELD.match(str(p))]
    name = ".".join(parts)
    return renames.get(name, name)


def from_validation_error(err: ValidationError, renames: dict[str, str] | None = None) -> APIError:
    """A 400 ``APIError`` naming the first invalid field (``param``) and every problem found.

    ``renames`` maps internal field names to request field names (``max_new_tokens`` ->
    ``max_tokens``).
    """
    renames = renames or {}
    problems, first = [], None
    for e in err.errors():
        name = _loc(e["loc"], renames)
        first = first or name or None
        msg = e["msg"].removeprefix("Value error, ")
        for old, new in renames.items():
            msg = msg.replace(old, new)
        if e["type"] == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        elif name and name in msg:
            problems.append(msg)
            continue
        problems.append(f"{name}: {msg}" if name else msg)
    return APIError(400, "; ".join(dict.fromkeys(problems)), param=first)
