"""Whether a request can ever run: the one fit check, shared by the router and the schedulers.

The router checks a route (sizes from the workers' ``WorkerStats``), the colocated and decode
schedulers check prompt + ``max_new_tokens``, the prefill scheduler the prompt alone; all raise
``RequestRejected``, whose text is what the client reads (the worker loop answers it as a 400
delta, the router as a 400 ``APIError`` with ``param``/``code``). Page counts for the SWA pool come
from ``cache.kv_budget.PageBudget`` (``swa_pages_at_once``). Plain Python: the router imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

SWA_POOL_EXCEEDED = "swa_pool_capacity_exceeded"


class RequestRejected(ValueError):
    """The request can never run on this worker or route (too long for a pool or the context).

    ``param`` names the offending request field and ``code`` is a short machine-readable reason
    (the router's OpenAI error fields); the message is the same wherever it is raised.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class FitCheck:
    """The limits a request is checked against, and the checks.

    ``pool`` names the KV pool in messages; ``restart`` is what to start with a larger pool
    ("worker", or "server" from the router); ``swa_pool_pages`` is the SWA pool's size in pages
    (None: no SWA pool, nothing to check there).
    """

    capacity_tokens: int
    max_model_len: int
    pool: str = "KV cache pool"
    restart: str = "worker"
    swa_pool_pages: int | None = None
    page_size: int = 1

    def request(self, prompt_len: int, max_new_tokens: int, swa_pages: int = 0) -> None:
        """Refuse an empty prompt, ``prompt + max_new_tokens`` over the context or the pool, and
        ``swa_pages`` SWA pages held at once over the SWA pool."""
        self._not_empty(prompt_len)
        total = prompt_len + max_new_tokens
        head = f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) = {total} exceeds the "
        if total > self.max_model_len:
            raise RequestRejected(
                head + f"model context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if total > self.capacity_tokens:
            raise RequestRejected(
                head + f"{self.pool} capacity of {self.capacity_tokens} tokens; lower max_tokens or "
                f"start the {self.restart} with a larger --kv-pool-tokens",
                param="max_tokens",
                code="kv_pool_capacity_exceeded",
            )
        self.swa(swa_pages)

    def prompt(self, prompt_len: int, swa_pages: int = 0) -> None:
        """A prefill worker's check: the prompt alone (decode tokens live elsewhere) against the
        pool, and ``swa_pages`` against the SWA pool."""
        self._not_empty(prompt_len)
        if prompt_len > self.capacity_tokens:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) exceeds the prefill worker's KV pool of "
                f"{self.capacity_tokens} tokens; start it with a larger --kv-pool-tokens",
                param="prompt",
                code="kv_pool_capacity_exceeded",
            )
        self.swa(swa_pages)

    def swa(self, need: int) -> None:
        """Refuse ``need`` SWA pages at once (admission or the decode window) over the SWA pool."""
        have = self.swa_pool_pages
        if have is not None and need > have:
            raise RequestRejected(
                f"this request needs {need} pages of the sliding-window KV pool at once, which "
                f"has {have} ({have * self.page_size} tokens); shorten the prompt or start the "
                f"{self.restart} with a larger --swa-pool-tokens",
                code=SWA_POOL_EXCEEDED,
            )

    @staticmethod
    def _not_empty(prompt_len: int) -> None:
        if prompt_len == 0:
            raise RequestRejected("prompt is empty; send at least one token", param="prompt")
