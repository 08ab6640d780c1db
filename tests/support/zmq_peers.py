"""Peer sockets for connection tests: a ROUTER bound (again) at an address, a polling wait."""

from __future__ import annotations

import time

import zmq


def wait_for(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def bind_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A ROUTER bound at ``endpoint`` (retried while the port of a just closed one is released)."""
    deadline = time.monotonic() + 5
    while True:
        s = ctx.socket(zmq.ROUTER)
        s.linger = 0
        try:
            s.bind(endpoint)
            return s
        except zmq.ZMQError:
            s.close(0)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
