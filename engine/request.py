"""Request state shared by every scheduler (colocated, prefill, decode): one lifecycle for all.

``Phase`` is the only state machine a request has, in every mode::

    colocated:  WAITING -> PREFILLING -> RUNNING -> FINISHED       (retract: RUNNING -> WAITING)
    prefill:    WAITING -> PREFILLING -> TRANSFER -> FINISHED
    decode:     PREALLOC -> TRANSFER -> RUNNING -> FINISHED        (RUNNING <-> RETRACTED, or
                                                                     RUNNING -> PREALLOC to recompute)

Any phase can go to FINISHED (abort, failure); only schedulers move requests between phases.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cache.handle import KVHandle
from engine.sampling import SamplerState
from transfer.wire.enums import FinishReason
from transfer.wire.protocol import PromptLogprobs
from transfer.wire.sampling_params import SamplingParams


class Phase(enum.StrEnum):
    """Where a request is in its worker's lifecycle (module docstring)."""

    WAITING = "waiting"  # queued for (re-)prefill
    PREFILLING = "prefilling"  # admitted; part of its prompt may be computed (chunked prefill)
    PREALLOC = "prealloc"  # decode worker: waiting for pages before it asks for the KV
    TRANSFER = "transfer"  # KV moving between workers (prefill: until shipped; decode: until landed)
    RUNNING = "running"  # in the decode batch
    RETRACTED = "retracted"  # decode worker: KV parked in the host pool, waiting to resume
    FINISHED = "finished"


class Release(enum.StrEnum):
    """How a retract victim's device pages were released (``RunningBatch.decode_step``'s
    ``release_victim`` returns it for the log line)."""

    DROP = "drop"  # colocated: KV freed, the request is prefilled again
    OFFLOAD = "offload"  # decode worker: KV copied to the host pool, resumed later
    RECOMPUTE = "recompute"  # decode worker: KV freed, a prefill worker computes it again


@dataclass(eq=False)
class Request:
    """One generation request.

    Token bookkeeping: ``all_ids = prompt_ids + output_ids``. ``kv_len`` tokens of ``all_ids``
    have their K/V in the pool, in the pages of ``kv`` (an opaque handle from ``KVManager``).
    While running, ``kv_len == len(all_ids) - 1``: the newest token is the input of the next
    decode step. ``owner`` is the control connection its token deltas go back to. ``marks``:
    monotonic times of its milestones on this worker (``mark``; see ``engine.scheduler.timeline``).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler_state: SamplerState
    owner: bytes = b""
    output_ids: list[int] = field(default_factory=list)
    status: Phase = Phase.WAITING
    kv: KVHandle = field(default_factory=KVHandle)
    kv_len: int = 0
    finish_reason: FinishReason | None = None
    retraction_count: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # engine.prompt_logprobs: filled by the prefill, sent once
    # a failover continuation's prefill (prompt + output so far) is still to come: admission counts its
    # computed and radix-hit tokens apart (SchedulerStats.continuation_*); a retract clears it
    continuation: bool = False
    marks: dict[str, float] = field(default_factory=lambda: {"arrived": time.monotonic()})

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def cached_tokens(self) -> int:
        return self.kv.cached_tokens

    @property
    def finished(self) -> bool:
        return self.status is Phase.FINISHED

    def mark(self, milestone: str, at: float | None = None) -> None:
        """Stamp ``milestone`` now (or at monotonic ``at``), unless it was stamped before (the first
        pass counts)."""
        self.marks.setdefault(milestone, time.monotonic() if at is None else at)

    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def finish(self, reason: FinishReason) -> None:
        self.status = Phase.FINISHED
        self.finish_reason = reason

    def reset_for_retract(self) -> None:
        """Forget all KV state (the caller frees the handle first); keep the output tokens."""
        assert self.kv.empty, "free the KV before resetting"
        self.kv_len = 0
        self.retraction_count += 1
        self.continuation = False  # its next prefill is the retract's recompute, not the failover's
        self.status = Phase.WAITING
