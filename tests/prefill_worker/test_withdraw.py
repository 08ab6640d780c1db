"""A decode worker's ``PrefillWithdrawn`` on the prefill side (``prefill_worker.withdraw``): a job
with a reserved destination whose prefill has not started leaves and its decode worker hears
``PrefillFailed`` (503: it may free those pages now); one being prefilled or written stays (its KV
lands as usual, never after the pages were freed); one with no destination leaves silently and a
late ``PrefillRequest`` of it is dropped (``BootstrapTable.gone``)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from prefill_worker.bootstrap import WITHDRAWN, BootstrapTable
from prefill_worker.withdraw import RELEASED, withdraw
from transfer.wire.outbox import Conn
from transfer.wire.protocol import PrefillFailed, PrefillWithdrawn

pytestmark = pytest.mark.unit

DECODE = Conn(b"decode-1")


class _Req:
    def __init__(self) -> None:
        self.kv, self.finished = object(), None

    def finish(self, reason) -> None:
        self.finished = reason


def _scheduler(dest: bool, started: bool = False, writing: bool = False):
    req = _Req()
    job = SimpleNamespace(req=req, dest=object() if dest else None, dest_conn=DECODE if dest else None, writing=writing)
    freed = []
    s = SimpleNamespace(
        jobs={(7, 0): job},
        bootstrapping=deque([] if dest else [req]),
        waiting=deque([req] if dest and not started else []),
        bootstrap=BootstrapTable(),
        by_req={id(req): job},
        kv=SimpleNamespace(free=freed.append),
        withdrawn=0,
    )
    return s, req, freed


MSG = PrefillWithdrawn(rid="r", room=7)


def test_a_reserved_destination_not_yet_prefilled_is_released_and_answered():
    s, req, freed = _scheduler(dest=True)
    out = withdraw(s, MSG)
    [sent] = out.messages
    assert sent.to == DECODE and sent.msg == PrefillFailed(
        rid="r", room=7, generation=0, error=RELEASED, error_status=503
    )
    assert s.jobs == {} and not s.waiting and freed == [req.kv] and req.finished is not None and s.withdrawn == 1
    assert out.tokens == []  # the router hears nothing from here: the decode worker's 503 re-sends it


@pytest.mark.parametrize("started,writing", [(True, False), (False, True)])
def test_a_prefill_under_way_is_not_released(started, writing):
    s, req, freed = _scheduler(dest=True, started=started, writing=writing)
    out = withdraw(s, MSG)
    assert out.messages == [] and (7, 0) in s.jobs and freed == [] and req.finished is None
    assert s.bootstrap.gone((7, 0)) is None


def test_no_destination_leaves_silently_and_a_late_prompt_is_dropped():
    s, req, freed = _scheduler(dest=False)
    out = withdraw(s, MSG)
    assert out.messages == [] and s.jobs == {} and not s.bootstrapping and freed == [req.kv]
    assert s.bootstrap.gone((7, 0)) == WITHDRAWN
