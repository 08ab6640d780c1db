"""What every worker scheduler (colocated, prefill, decode) shares with the worker loop.

Subclasses set ``runner`` (``ModelRunner``), ``kv`` (``KVManager``) and ``stats``
(``SchedulerStats``) and implement ``live_requests()``.
"""
from __future__ import annotations

import abc


class RequestRejected(ValueError):
    """The request can never run on this worker (too long for the pool or the context)."""


def check_fits(prompt_len: int, max_new_tokens: int, capacity: int, context: int, pool: str = "KV cache pool") -> None:
    """Raise ``RequestRejected`` with the numbers if ``prompt + max_new_tokens`` can never run."""
    total = prompt_len + max_new_tokens
    if prompt_len == 0:
        raise RequestRejected("prompt is empty; send at least one token")
    if total > context:
        raise RequestRejected(f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) = {total} exceeds the "
                              f"model context of {context} tokens; shorten the prompt or lower max_tokens")
    if total > capacity:
        raise RequestRejected(f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) = {total} exceeds the "
                              f"{pool} capacity of {capacity} tokens; lower max_tokens or start the worker with "
                              f"a larger --kv-pool-tokens")


class WorkerScheduler(abc.ABC):
    runner = None
    kv = None
    stats = None

    @abc.abstractmethod
    def live_requests(self) -> list:
        """Every request that holds or may hold KV state on this worker."""

    @property
    def capacity_tokens(self) -> int:
        return self.runner.capacity_tokens

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    def check_integrity(self) -> None:
        """Pool invariant (free + used + cached == total), radix locks, allocator consistency."""
        self.kv.check_integrity(self.live_requests())

    def base_counters(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.stats.as_dict().items()}

    def pool_gauges(self) -> dict[str, float]:
        u = self.kv.usage(self.live_requests())
        return {"kv_pages_free": u.free, "kv_pages_used": u.used, "kv_pages_cached": u.cached,
                "kv_pages_total": u.total}
