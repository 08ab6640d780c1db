"""``LinkWatch``: the verdict "the peer's process is gone" from a connecting socket's monitor
events. The event sequences are those libzmq 4.3 gives a DEALER (recorded against a ROUTER in
another process): ``kill -9`` of the peer (drop, then every reconnect refused) and SIGSTOP of it (a
ZMTP heartbeat timeout drops the connection, the reconnect is accepted by the peer's kernel and the
handshake never comes). Then real sockets in process: a ROUTER closed under a connected DEALER."""

from __future__ import annotations

import time

import zmq

from tests.support.zmq_peers import bind_router, wait_for
from transfer.control_auth import ControlAuth
from transfer.link_watch import DROPPED, NEVER, UP, LinkWatch

E = zmq
KILLED = [
    E.EVENT_CONNECT_DELAYED,
    E.EVENT_CONNECTED,
    E.EVENT_HANDSHAKE_SUCCEEDED,
    E.EVENT_DISCONNECTED,  # the peer's kernel closed the connection
    E.EVENT_CONNECT_RETRIED,
    E.EVENT_CONNECT_DELAYED,
    E.EVENT_CLOSED,  # reconnect refused
    E.EVENT_CONNECT_RETRIED,
    E.EVENT_CONNECT_DELAYED,
    E.EVENT_CLOSED,  # and again, at the next interval
]
STOPPED = [
    E.EVENT_CONNECT_DELAYED,
    E.EVENT_CONNECTED,
    E.EVENT_HANDSHAKE_SUCCEEDED,
    E.EVENT_DISCONNECTED,  # ZMTP heartbeat timeout
    E.EVENT_CONNECT_RETRIED,
    E.EVENT_CONNECT_DELAYED,
    E.EVENT_CONNECTED,  # the stopped process's kernel accepts; no handshake follows
]


def watch() -> tuple[LinkWatch, list[str]]:
    reasons: list[str] = []
    return LinkWatch("tcp://h:1", reasons.append), reasons


def feed(w: LinkWatch, events: list[int]) -> None:
    for e in events:
        w.feed(e)


def test_a_drop_followed_by_a_refused_reconnect_is_one_verdict():
    w, reasons = watch()
    feed(w, KILLED)
    assert len(reasons) == 1 and "(tcp://h:1) closed and the reconnect was refused" in reasons[0]
    assert (w.drops, w.lost, w.state) == (1, 1, NEVER)
    # a new process answers at the address, then dies too: a second verdict
    feed(w, [E.EVENT_CONNECTED, E.EVENT_HANDSHAKE_SUCCEEDED])
    assert w.state == UP
    feed(w, KILLED[3:7])
    assert (w.drops, w.lost) == (2, 2)


def test_a_drop_whose_reconnect_is_accepted_is_no_verdict():
    w, reasons = watch()
    feed(w, STOPPED)
    assert reasons == [] and (w.drops, w.state) == (1, DROPPED)
    feed(w, [E.EVENT_HANDSHAKE_SUCCEEDED])  # SIGCONT: the handshake completes, the link is up again
    assert w.state == UP and reasons == []


def test_refused_attempts_before_the_first_handshake_are_a_peer_not_started_yet():
    w, reasons = watch()
    feed(w, [E.EVENT_CONNECT_DELAYED, E.EVENT_CLOSED, E.EVENT_CONNECT_RETRIED] * 3)
    assert reasons == [] and (w.drops, w.state) == (0, NEVER)


def test_a_closed_peer_socket_gives_the_verdict_through_the_monitor_and_a_new_one_is_taken_back():
    """Real sockets: a DEALER set up as the router's (reconnect every 200 ms, its watch from
    ``ControlAuth.client``) against a ROUTER that is closed (nothing listens: what a dead process
    leaves), bound again, and closed again."""
    peer_ctx, ctx = zmq.Context(), zmq.Context()
    reasons: list[str] = []
    router = bind_router(peer_ctx, "tcp://127.0.0.1:*")
    endpoint = router.last_endpoint.decode()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.setsockopt(zmq.RECONNECT_IVL, 200)
    link = LinkWatch(endpoint, reasons.append)
    ControlAuth.insecure().client(dealer, "test", link)
    dealer.connect(endpoint)
    try:
        assert wait_for(lambda: link.state == UP)
        assert reasons == []
        router.close(0)
        t0 = time.monotonic()
        assert wait_for(lambda: len(reasons) == 1), link.state
        assert time.monotonic() - t0 < 2.0  # the first reconnect, 200 ms on, is refused
        assert link.drops == 1 and f"({endpoint}) closed" in reasons[0]
        router = bind_router(peer_ctx, endpoint)  # a new process at the address
        assert wait_for(lambda: link.state == UP)
        time.sleep(0.5)
        assert len(reasons) == 1
        router.close(0)
        assert wait_for(lambda: len(reasons) == 2)
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
        peer_ctx.term()
