"""Whether the process behind a connecting ZMQ socket is gone, from the socket's monitor events.

A process that dies (``kill -9``, a crash, the OOM killer) has its TCP connections closed by its
kernel: the connecting socket sees ``EVENT_DISCONNECTED`` at once, and its next connection attempt,
``RECONNECT_IVL`` later, is refused because nothing listens on the port any more (libzmq reports the
failed attempt as ``EVENT_CLOSED``). A drop followed by a refused reconnect, with no successful
handshake in between, is the verdict **gone**; ``on_lost`` is called once for it.

Nothing else is a verdict, so a live peer is never declared gone by its transport:

- a connection that drops while the peer still listens (a reset connection, a ZMTP heartbeat
  timeout) reconnects, and the peer's kernel accepts the new connection (``EVENT_CONNECTED``), even
  when the process is stopped (SIGSTOP) and never completes the handshake: a silent peer is for the
  heartbeats (``--worker-timeout-s``) to judge;
- refused attempts before the first handshake are a peer not started yet.

Limits: a peer whose host vanished (a machine off, a container's address gone) answers nothing, not
even a refusal, and a name that no longer resolves is retried without a refused attempt: both are
left to the heartbeats as well.

Feed events from one thread (the monitor's reader); ``on_lost`` runs on that thread.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

# the monitor events the verdict is made of (on top of EVENT_HANDSHAKE_SUCCEEDED)
LINK_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED

NEVER, UP, DROPPED = "never connected", "up", "dropped"


class LinkWatch:
    """The connection state of one connecting socket and the one verdict per drop (see the module)."""

    def __init__(self, addr: str, on_lost: Callable[[str], None]) -> None:
        """``addr``: the peer's address (for the reason); ``on_lost(reason)``: called once per drop
        whose reconnect was refused."""
        self.addr = addr
        self.on_lost = on_lost
        self.state = NEVER
        self.drops = 0  # connections that were up and dropped (lost or not)
        self.lost = 0  # verdicts given

    def feed(self, event: int) -> None:
        """One monitor event of the socket, in the order the monitor delivered them."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.state = UP
        elif event == zmq.EVENT_DISCONNECTED and self.state == UP:
            self.state, self.drops = DROPPED, self.drops + 1
        elif event == zmq.EVENT_CLOSED and self.state == DROPPED:
            # one verdict per drop: later refused attempts wait for the next handshake and drop
            self.state, self.lost = NEVER, self.lost + 1
            self.on_lost(
                f"its control connection ({self.addr}) closed and the reconnect was refused: "
                f"nothing listens there, the process is gone"
            )
