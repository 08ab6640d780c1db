"""The PD handoff at low load, in one process with the real schedulers: the
decode worker does not poll its transport while the prefill worker is still computing the room
(the loop sleeps on its sockets; the prefill worker's ``KVWriteStarted`` wakes it), and polls it
once the write is announced; the request ends with the same tokens either way."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import DECODE_CONN, PDHarness, checked_harnesses
from configs.schema import PdserveConfig
from transfer.wire.outbox import Conn
from transfer.wire.protocol import KVDestination, KVWriteStarted
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0)


def cfg() -> PdserveConfig:
    return PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 512, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda: PDHarness(cfg(), cfg(), tiny[0], tiny[1]))


def _until_destination_sent(h: PDHarness) -> None:
    """Step until the decode worker reserved the room and its ``KVDestination`` waits for delivery."""
    for _ in range(10):
        h.step()
        if any(isinstance(m, KVDestination) for m, _ in h.to_prefill):
            return
    raise AssertionError("the decode worker never sent a KVDestination")


def test_decode_does_not_poll_while_prefill_computes(harness):
    h = harness()
    poll = h.decode.transfers.transport.poll_interval_s
    assert poll > 0
    h.submit("r0", list(range(3, 40)), GREEDY)
    _until_destination_sent(h)
    assert h.decode.transfers.inflight, "the room is reserved and in flight"
    # the prefill worker has not computed the room yet: nothing can land, so no transport poll is due
    wait = h.decode.idle_wait_s()
    assert wait is None or wait > 100 * poll, wait
    # deliver the destination; the prefill turn computes the prompt and starts the write
    h._exchange()
    out = h.prefill_turns.run().outbox
    started = [m for m in out.messages if isinstance(m.msg, KVWriteStarted)]
    assert len(started) == 1 and started[0].to == Conn(DECODE_CONN)
    assert (started[0].msg.rid, started[0].msg.generation) == ("r0", 0)
    h.router_inbox += h.deliver(out, False)
    h._exchange()
    assert h.decode.idle_wait_s() == poll, "an announced write is polled for"
    done = h.run()
    assert done["r0"]["finish"] == "length" and len(done["r0"]["tokens"]) == 4


def test_same_tokens_with_and_without_the_announcement(harness):
    """A writer that announces nothing (an older prefill worker) still lands: every decode turn
    polls the transport, the announcement only decides how soon an idle loop wakes up."""
    prompt = list(range(5, 30))
    h1 = harness()
    h1.submit("a", prompt, GREEDY)
    with_hint = h1.run()["a"]["tokens"]
    h2 = harness()
    real = h2.prefill._start_transfers

    def silent():
        out = real()
        out.messages[:] = [m for m in out.messages if not isinstance(m.msg, KVWriteStarted)]
        return out

    h2.prefill._start_transfers = silent
    h2.submit("a", prompt, GREEDY)
    assert h2.run()["a"]["tokens"] == with_hint


def test_announcement_for_an_unknown_room_is_ignored(harness):
    h = harness()
    h.submit("r0", list(range(3, 20)), GREEDY)
    _until_destination_sent(h)
    h.decode.transfers.posted(KVWriteStarted(rid="other", room=999))
    assert not h.decode.transfers.polling


def test_trace_lines_up_router_and_worker_stamps():
    """``benchmarks.handoff_trace`` reads the stamps the way the router and the workers log them
    (``engine.scheduler.timeline.marks_text`` under each process's log format)."""
    import logging

    from benchmarks.handoff_trace import parse_marks
    from engine.scheduler.timeline import marks_text

    def line(fmt: str, name: str, msg: str) -> str:
        return logging.Formatter(fmt).format(logging.LogRecord(name, logging.DEBUG, __file__, 1, msg, None, None))

    worker_fmt = "%(asctime)s %(levelname)s [{}] %(name)s: %(message)s"
    router_fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    text = "\n".join(
        [
            line(
                router_fmt,
                "server.router.session",
                "request req-1 marks (monotonic s): arrived=10.000000 sent=10.001000",
            ),
            line(
                worker_fmt.format("prefill-0"),
                "engine.scheduler.timeline",
                "request req-1 marks (monotonic s): " + marks_text({"destination": 10.003, "arrived": 10.002}),
            ),
            line(
                worker_fmt.format("decode-0"),
                "engine.scheduler.timeline",
                "request req-1 marks (monotonic s): " + marks_text({"arrived": 10.0015, "landed": 10.5}),
            ),
            line(
                worker_fmt.format("prefill-0"), "engine.scheduler.timeline", "request req-1 (length) phases in ms: x=1"
            ),
        ]
    )
    got = parse_marks(text)
    assert got == {
        "req-1": {
            "router": {"arrived": 10.0, "sent": 10.001},
            "prefill": {"arrived": 10.002, "destination": 10.003},
            "decode": {"arrived": 10.0015, "landed": 10.5},
        }
    }


def test_burst_split_sums_each_sides_prefill_seconds():
    """``benchmarks.burst_split`` reads each role's prefill seconds from the phase histograms' sums."""
    from benchmarks.burst_split import phase_sum

    name = "pdserve_request_phase_seconds_sum"
    m = {
        (name, (("phase", "prefill_compute"), ("worker", "prefill-0"))): 2.5,
        (name, (("phase", "prefill_compute"), ("worker", "prefill-1"))): 1.0,
        (name, (("phase", "local_prefill"), ("worker", "decode-0"))): 0.75,
        (name, (("phase", "decode"), ("worker", "decode-0"))): 9.0,
        ("pdserve_request_phase_seconds_count", (("phase", "prefill_compute"), ("worker", "prefill-0"))): 7.0,
    }
    assert phase_sum(m, "prefill", "prefill_compute") == 3.5
    assert phase_sum(m, "decode", "local_prefill") == 0.75
    assert phase_sum(m, "decode", "prefill_compute") == 0.0
