"""The router keeps an idle keep-alive connection open past client pools' expiry (httpx: 5 s), so a
client reusing it gets a response, not a transport error (``launcher.KEEP_ALIVE_S``)."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

import pytest

from server.launch.launcher import KEEP_ALIVE_S

pytestmark = pytest.mark.process

IDLE_S = 6.0  # past httpx's default keepalive_expiry (5 s) and uvicorn's default timeout_keep_alive (5 s)


def test_an_idle_connection_is_still_open_after_a_client_pools_expiry(pd_server):
    assert KEEP_ALIVE_S > IDLE_S
    u = urlsplit(pd_server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        time.sleep(IDLE_S)
        conn.request("GET", "/health")  # the same socket: http.client reconnects only if told it closed
        second = conn.getresponse()
        assert second.status == 200 and second.read()
    finally:
        conn.close()
