"""What a scheduler step reports back to its driver (CLI, router connection)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenEvent:
    """New tokens of one request this step; ``finish_reason`` set on its last event.

    ``finish_reason`` is "stop", "length" or "abort"; an abort carries ``error`` (a message for
    the client) and ``error_status`` (the HTTP status class the router should answer with).
    """

    rid: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_status: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
