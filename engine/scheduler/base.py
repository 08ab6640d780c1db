"""The contract between a worker loop and its scheduler (colocated, prefill or decode).

A scheduler does no I/O on control sockets: every call returns an ``Outbox`` (``transfer.wire.outbox``)
of what should be sent, ``settle`` and ``step`` a ``StepReport`` (that outbox plus facts about the
step), and the worker loop (or an in-process harness) delivers it.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache.handle import KVHandle
from cache.kv_manager import KVManager
from engine.scheduler.stats import Histogram, SchedulerStats
from engine.scheduler.step_report import StepReport
from transfer.wire.outbox import Dest, Outbox
from transfer.wire.protocol import GenerateRequest, Message, TokenDelta, WorkerStats


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


@dataclass(frozen=True)
class Outcome:
    """How a request ends: "stop"/"length" (completed: its KV may go to the radix cache) or
    "abort" with an error for the client and the HTTP status to answer with."""

    reason: str
    error: str | None = None
    status: int | None = None

    @classmethod
    def abort(cls, error: str, status: int) -> "Outcome":
        return cls("abort", error, status)

    @property
    def completed(self) -> bool:
        return self.reason != "abort"

    def delta(self, rid: str) -> TokenDelta:
        """The closing delta of an abort (a completed request's last delta carries its last token)."""
        return TokenDelta.failed(rid, self.error or "request aborted", self.status or 500)


@dataclass(frozen=True)
class Snapshot:
    """Metrics a worker publishes: cumulative counters, current gauges, histograms."""

    counters: dict[str, float]
    gauges: dict[str, float]
    histograms: dict[str, Histogram] = field(default_factory=dict)


class WorkerScheduler(abc.ABC):
    """One worker's scheduling state machine. Driven by a single thread; none of its methods
    block on or touch a socket. ``add`` raises ``RequestRejected`` (nothing queued) for a
    request that can never run; ``abort`` is idempotent; ``handle`` returns None for a message
    this role does not take (the loop logs it)."""

    role: str

    def __init__(self, runner, kv: KVManager) -> None:
        self.runner = runner
        self.kv = kv
        self.stats = SchedulerStats()

    @abc.abstractmethod
    def add(self, owner: bytes, msg: GenerateRequest, prompt: list[int]) -> Outbox:
        """Queue a new request from connection ``owner``."""

    @abc.abstractmethod
    def abort(self, rid: str, reason: str = "request aborted") -> Outbox:
        """End ``rid`` wherever it is (unknown or finished ids: empty outbox)."""

    def settle(self) -> StepReport:
        """Take in what ended in the background since the last call (a prefill worker's KV
        writes) without running the model, so a caller learns of handoffs before ``step``.
        Default: nothing to settle."""
        return StepReport()

    @abc.abstractmethod
    def step(self) -> StepReport:
        """Run one scheduling iteration: ``settle``, then at most one forward pass."""

    @abc.abstractmethod
    def handle(self, source: Dest, msg: Message, frames: list[bytes]) -> Outbox | None:
        """A role-specific message from ``source``."""

    def peer_heartbeat(self, addr: str, stats: WorkerStats, at: float) -> Outbox:
        """A heartbeat reply from the peer worker at ``addr`` (the loop's ``Peer`` destinations),
        received at monotonic time ``at`` on the loop's pinger thread. Default: no peers."""
        return Outbox()

    @property
    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while ``step`` has compute to do now (the loop must not block on its sockets)."""

    @property
    def has_model_work(self) -> bool:
        """True while ``step`` has a forward pass to run; bookkeeping-only work such as a decode
        worker's page reservations does not count. Default: ``has_work``."""
        return self.has_work

    @abc.abstractmethod
    def idle_wait_s(self) -> float | None:
        """With no work: how long the loop may block on its sockets before ``step`` is due anyway
        (a transfer to poll, a heartbeat or a deadline); None when only a message can bring work."""

    @abc.abstractmethod
    def live_handles(self) -> Sequence[KVHandle]:
        """KV handles of every request that holds or may hold pages on this worker."""

    def snapshot(self) -> Snapshot:
        counters = {k: float(v) for k, v in self.stats.as_dict().items()}
        if self.kv.has_swa:
            counters["swa_pages_released"] = float(self.kv.swa_pages_released)
        return Snapshot(counters, self.pool_gauges())

    @property
    def capacity_tokens(self) -> int:
        return self.runner.capacity_tokens

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    def reject_if_unfit(self, prompt_len: int, max_new_tokens: int, pool: str = "KV cache pool",
                        swa_tokens: int | None = None) -> None:
        """``check_fits`` against this worker's pool and context, and against its SWA pool for
        ``swa_tokens`` (default: the whole prompt) of SWA KV at admission, counting refusals."""
        try:
            check_fits(prompt_len, max_new_tokens, self.capacity_tokens, self.max_model_len, pool)
            self.check_swa_fits(prompt_len if swa_tokens is None else swa_tokens)
        except RequestRejected:
            self.stats.rejected_requests += 1
            raise

    def prefill_swa_tokens(self, prompt_len: int, chunk: int) -> int:
        """SWA KV a prompt holds at once while it is prefilled in chunks of ``chunk`` tokens: one
        chunk plus the window before it."""
        window = self.kv.window.max_pages() * self.kv.page_size if self.kv.has_swa else 0
        return min(prompt_len, chunk + window)

    def check_swa_fits(self, swa_tokens: int) -> None:
        """Refuse a request whose SWA KV at admission (or its decode window) exceeds the SWA pool."""
        kv = self.kv
        if not kv.has_swa:
            return
        need, have = max(kv.pages_for(swa_tokens), kv.window.max_pages()), kv.swa_allocator.num_pages
        if need > have:
            self.stats.swa_rejections += 1
            raise RequestRejected(f"this request needs {need} pages of the sliding-window KV pool at once, which "
                                  f"has {have} ({have * kv.page_size} tokens); shorten the prompt or start the "
                                  f"worker with a larger --swa-pool-tokens")

    def check_integrity(self) -> None:
        """Pool invariant (free + used + cached == total), radix locks, allocator consistency."""
        self.kv.check_integrity(self.live_handles())

    def pool_gauges(self) -> dict[str, float]:
        live = self.live_handles()
        u = self.kv.usage(live)
        gauges = {"kv_pages_free": u.free, "kv_pages_used": u.used, "kv_pages_cached": u.cached,
                  "kv_pages_total": u.total}
        if (s := self.kv.usage(live, "swa")) is not None:
            gauges.update(swa_pages_free=s.free, swa_pages_used=s.used, swa_pages_cached=s.cached,
                          swa_pages_total=s.total)
        return gauges
