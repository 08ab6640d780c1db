"""Decode-side state of one PD request on top of the shared ``Request``."""
from __future__ import annotations

from dataclasses import dataclass

from cache.host_pool import HostKV
from engine.request import Request
from engine.scheduler.base import Outcome


@dataclass(eq=False)
class DecodeJob:
    """A PD request on the decode worker; its phase is ``req.status`` (PREALLOC -> TRANSFER ->
    RUNNING <-> RETRACTED -> FINISHED).

    ``generation`` counts prefills of this request: 0 is the router's; each recompute after a
    retract whose KV could not be kept asks the prefill worker again with ``generation + 1`` for
    ``n_tokens = seq_len - 1`` tokens (prompt + output so far, minus the next input token).
    ``answered`` is set once the client got its last word (an abort): a job still in TRANSFER
    then keeps its pages (fenced since ``fenced_at``) until no remote write can land in them.
    """

    req: Request
    room: int
    prefill_addr: str
    generation: int = 0
    n_tokens: int = 0
    decode_prefix_len: int = 0
    host_kv: HostKV | None = None
    answered: Outcome | None = None
    fenced_at: float = 0.0

    @property
    def key(self) -> tuple[int, int]:
        return self.room, self.generation
