"""Decode-side state of one PD request on top of the shared ``Request``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cache.host_pool import HostKV
from engine.request import Request


@dataclass(eq=False)
class DecodeJob:
    """``phase``: prealloc -> transfer -> running (<-> retracted) -> done.

    ``generation`` counts prefills of this request: 0 is the router's; each recompute after a
    retract whose KV could not be kept asks the prefill worker again with ``generation + 1`` for
    ``n_tokens = seq_len - 1`` tokens (prompt + output so far, minus the next input token).
    While ``phase == "transfer"`` the pages may still be written remotely: they are freed only
    when the transfer's notification or a ``PrefillFailed`` arrives, or the peer is dead.
    """

    req: Request
    room: int
    prefill_addr: str
    generation: int = 0
    n_tokens: int = 0
    decode_prefix_len: int = 0
    phase: str = "prealloc"
    host_kv: HostKV | None = None
    aborted: str | None = None
    fenced_at: float = 0.0
    phase_since: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[int, int]:
        return self.room, self.generation

    def enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_since = time.monotonic()
