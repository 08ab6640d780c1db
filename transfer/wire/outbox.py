"""What a scheduler hands its worker loop to send: the ``Outbox`` and its typed destinations.

``Conn`` is a connection on the worker's own control socket (the router, or a peer worker that
connected to it), ``Peer`` a worker this one connects to by address (decode -> prefill). Plain data:
no sockets, no torch; the worker loop (or an in-process harness) delivers an outbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transfer.wire.protocol import Message, TokenDelta


@dataclass(frozen=True)
class Conn:
    """A connection on this worker's control socket, by its ZMQ identity."""

    ident: bytes


@dataclass(frozen=True)
class Peer:
    """Another worker, by control address; the loop connects to it on first use."""

    addr: str


Dest = Conn | Peer


@dataclass(frozen=True)
class Outbound:
    to: Dest
    msg: Message
    frames: tuple[bytes, ...] = ()


@dataclass
class Outbox:
    """What one scheduler call wants sent: token deltas (each to its request's owner connection,
    batched per step by the loop) and control messages."""

    tokens: list[tuple[bytes, TokenDelta]] = field(default_factory=list)
    messages: list[Outbound] = field(default_factory=list)

    def token(self, owner: bytes, delta: TokenDelta) -> None:
        self.tokens.append((owner, delta))

    def send(self, to: Dest, msg: Message, *frames: bytes) -> None:
        self.messages.append(Outbound(to, msg, frames))

    def extend(self, other: Outbox | None) -> Outbox:
        if other is not None:
            self.tokens += other.tokens
            self.messages += other.messages
        return self

    @property
    def deltas(self) -> list[TokenDelta]:
        return [d for _, d in self.tokens]

    def __bool__(self) -> bool:
        return bool(self.tokens or self.messages)
