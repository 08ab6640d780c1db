"""The contract between a worker loop and its scheduler (colocated, prefill or decode).

A scheduler does no I/O on control sockets: every call returns an ``Outbox`` (``transfer.wire.outbox``)
of what should be sent, ``settle`` and ``step`` a ``StepReport`` (that outbox plus facts about the
step), and the worker loop (or an in-process harness) delivers it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from cache.fit import SWA_POOL_EXCEEDED, FitCheck, RequestRejected  # schedulers import RequestRejected here
from cache.handle import KVHandle
from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from engine.sampling import SamplerState
from engine.scheduler.stats import Histogram, SchedulerStats
from engine.scheduler.step_report import StepReport
from transfer.wire.enums import FinishReason, Role
from transfer.wire.outbox import Dest, Outbox
from transfer.wire.protocol import GenerateRequest, Message, TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams


def sampler_state(runner, params: SamplingParams, prompt: Sequence[int], resumed: Sequence[int] = ()) -> SamplerState:
    """``runner.sampler_state`` (a ``ModelRunner``'s: with the grammar matcher of a structured-output
    request); a constraint the grammar engine refuses is a ``RequestRejected`` (400) naming it.

    ``resumed``: a continuation's output already streamed (``GenerateRequest.resume_output_ids``),
    appended as if this worker had generated it, so the seeded draw, the frequency / presence
    counts and the grammar matcher continue at output index ``len(resumed)``."""
    try:
        state = runner.sampler_state(params, list(prompt))
    except (ValueError, ModuleNotFoundError) as e:
        raise RequestRejected(str(e), param="response_format") from None
    try:
        for tok in resumed:
            state.append(tok)
    except ValueError as e:
        raise RequestRejected(f"resume_output_ids: {e}") from None
    return state


def check_resume(msg: GenerateRequest) -> None:
    """A continuation must leave at least one token to generate under ``max_new_tokens`` (which
    counts the tokens already streamed); ``RequestRejected`` otherwise."""
    k = len(msg.resume_output_ids)
    if k and k >= msg.params.max_new_tokens:
        raise RequestRejected(
            f"a continuation after {k} streamed tokens leaves nothing to generate "
            f"(max_tokens {msg.params.max_new_tokens})",
            param="max_tokens",
        )


@dataclass(frozen=True)
class Outcome:
    """How a request ends: "stop"/"length" (completed: its KV may go to the radix cache) or
    "abort" with an error for the client and the HTTP status to answer with."""

    reason: FinishReason
    error: str | None = None
    status: int | None = None
    handed_back: bool = False  # a decode worker changing role gives it back to the router (``TokenDelta``)

    @classmethod
    def abort(cls, error: str, status: int, handed_back: bool = False) -> Outcome:
        return cls(FinishReason.ABORT, error, status, handed_back)

    @property
    def completed(self) -> bool:
        return self.reason != FinishReason.ABORT

    def delta(self, rid: str) -> TokenDelta:
        """The closing delta of an abort (a completed request's last delta carries its last token)."""
        return TokenDelta.failed(rid, self.error or "request aborted", self.status or 500, self.handed_back)


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

    role: Role

    def __init__(self, runner, kv: KVManager) -> None:
        self.runner = runner
        self.kv = kv
        self.budget = PageBudget(kv)
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

    # True while requests here wait for another worker (a decode worker's requests whose KV is being
    # or about to be written) and will run the model once that is done: core lending keeps a worker
    # that just handed off KV from borrowing this one's cores while it is set. A subclass may make it
    # a property; most schedulers never wait so.
    has_queued_model_work: bool = False

    @property
    def awaits_peer_compute(self) -> bool:
        """True while another worker computes for this one (a decode worker's requests whose prompt
        a prefill worker holds or is about to get): core lending keeps such a worker from borrowing
        the cores that peer is about to need. Default: False."""
        return False

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

    def fit_check(self, pool: str = "KV cache pool") -> FitCheck:
        """The fit check against this worker's pool (named ``pool`` in messages), context and SWA pool."""
        return FitCheck(
            self.capacity_tokens,
            self.max_model_len,
            pool,
            swa_pool_pages=self.budget.swa_pool_pages,
            page_size=self.kv.page_size,
        )

    def reject_if_unfit(
        self, prompt_len: int, max_new_tokens: int, pool: str = "KV cache pool", swa_tokens: int | None = None
    ) -> None:
        """``FitCheck.request`` against this worker's pools and context, with ``swa_tokens``
        (default: the whole prompt) of SWA KV at admission, counting refusals."""
        swa_pages = self.budget.swa_pages_at_once(prompt_len if swa_tokens is None else swa_tokens)
        self.counting_rejections(lambda: self.fit_check(pool).request(prompt_len, max_new_tokens, swa_pages))

    def counting_rejections(self, check) -> None:
        """Run ``check()``; count a ``RequestRejected`` it raises (and an SWA pool one apart) and re-raise."""
        try:
            check()
        except RequestRejected as e:
            self.stats.rejected_requests += 1
            if e.code == SWA_POOL_EXCEEDED:
                self.stats.swa_rejections += 1
            raise

    def check_integrity(self) -> None:
        """Pool invariant (free + used + cached == total), radix locks, allocator consistency."""
        self.kv.check_integrity(self.live_handles())

    def pool_gauges(self) -> dict[str, float]:
        live = self.live_handles()
        u = self.kv.usage(live)
        gauges = {
            "kv_pages_free": u.free,
            "kv_pages_used": u.used,
            "kv_pages_cached": u.cached,
            "kv_pages_total": u.total,
        }
        if (s := self.kv.usage(live, "swa")) is not None:
            gauges.update(
                swa_pages_free=s.free, swa_pages_used=s.used, swa_pages_cached=s.cached, swa_pages_total=s.total
            )
        return gauges
