"""Request state shared by every scheduler (colocated, prefill, decode)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling import SamplerState, SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"        # queued for (re-)prefill
    PREFILLING = "prefilling"  # part of its prompt is computed (chunked prefill)
    RUNNING = "running"        # in the decode batch
    RETRACTED = "retracted"    # evicted from the decode batch under memory pressure
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request.

    Token bookkeeping: ``all_ids = prompt_ids + output_ids``. ``kv_len`` tokens of ``all_ids``
    have their K/V in the pool, in ``pages`` (page j holds tokens ``[j*P, (j+1)*P)``). The first
    ``num_shared_pages`` pages belong to the radix cache (locked through ``prefix_node``); the
    rest are owned by this request. While running, ``kv_len == len(all_ids) - 1``: the newest
    token is the input of the next decode step.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler_state: SamplerState
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    pages: list[int] = field(default_factory=list)
    num_shared_pages: int = 0
    prefix_node: object | None = None
    kv_len: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_status: int | None = None
    retraction_count: int = 0
    retracted_stain: bool = False
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_shared_pages:]

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

    def finish(self, reason: str, error: str | None = None, status: int | None = None) -> None:
        self.status = ReqStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.error_status = status

    def reset_for_retract(self) -> None:
        """Forget all KV state (pages are released by the caller first); keep the output tokens."""
        assert not self.pages and self.prefix_node is None, "release the KV before resetting"
        self.kv_len = 0
        self.num_shared_pages = 0
        self.cached_tokens = 0
        self.retraction_count += 1
        self.retracted_stain = True
        self.status = ReqStatus.WAITING
