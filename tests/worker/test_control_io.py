"""The worker's control-socket thread: heartbeats answered during a long scheduler step, other
messages relayed both ways unchanged, and silence once the scheduler thread has stalled (over
CURVE with a cluster key, as workers serve)."""

from __future__ import annotations

import time

import pytest
import zmq

from server.worker.control_io import ControlIO
from transfer.cluster_key import ClusterKey
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import AbortRequest, StatsRequest, WorkerStats, decode, encode


def stats(nonce=0):
    return WorkerStats(
        worker_id="w", role="decode", model="m", capacity_tokens=1, max_model_len=1, page_size=1, nonce=nonce
    )


@pytest.fixture
def io_and_client():
    ctx = zmq.Context()
    auth = ControlAuth(ClusterKey.generate())
    io = ControlIO(ctx, "tcp://127.0.0.1:0", stall_limit_s=0.5, auth=auth)
    addr = io.router.getsockopt(zmq.LAST_ENDPOINT).decode()
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    auth.client(client, "test client")
    client.connect(addr)
    io.publish(stats())
    io.start()
    yield io, client
    client.close(0)
    io.close()
    ctx.term()


def test_heartbeat_answered_while_the_scheduler_is_busy(io_and_client):
    io, client = io_and_client
    client.send_multipart(encode(StatsRequest(nonce=42)))
    assert client.poll(2000), "no heartbeat reply although the scheduler thread never read"
    msg, _ = decode(client.recv_multipart())
    assert isinstance(msg, WorkerStats) and msg.nonce == 42


def test_other_messages_are_relayed_both_ways(io_and_client):
    io, client = io_and_client
    client.send_multipart(encode(AbortRequest(rids=["a"])))
    assert io.scheduler_end.poll(2000)
    ident, *parts = io.scheduler_end.recv_multipart()
    assert isinstance(decode(parts)[0], AbortRequest)
    io.scheduler_end.send_multipart([ident, *encode(stats(7))])
    assert client.poll(2000) and decode(client.recv_multipart())[0].nonce == 7


def test_stalled_scheduler_gets_no_heartbeat_replies(io_and_client):
    io, client = io_and_client
    time.sleep(0.7)  # no publish()/alive() for longer than stall_limit_s
    client.send_multipart(encode(StatsRequest(nonce=1)))
    assert not client.poll(500)
    io.alive()  # progress again: the next heartbeat is answered (the dropped one stays dropped)
    client.send_multipart(encode(StatsRequest(nonce=2)))
    assert client.poll(2000) and decode(client.recv_multipart())[0].nonce == 2
