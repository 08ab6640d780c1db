"""``ExitWatch``: the launcher's supervision wakes the moment a worker process exits (SIGKILL
included), not at its next half-second tick; with nothing exiting it waits the whole timeout."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest

from server.launch.exit_watch import ExitWatch

pytestmark = pytest.mark.process  # a child process to kill


def test_a_killed_child_wakes_the_wait_at_once_and_a_live_one_does_not():
    async def scenario() -> tuple[float, float, float]:
        child = subprocess.Popen(["sleep", "30"])
        watch = ExitWatch(asyncio.get_running_loop())
        stop = asyncio.Event()
        try:
            watch.track([child.pid])
            t0 = time.monotonic()
            await watch.wait(stop, 0.3)  # alive: the whole timeout
            idle = time.monotonic() - t0
            asyncio.get_running_loop().call_later(0.05, child.send_signal, signal.SIGKILL)
            t0 = time.monotonic()
            await watch.wait(stop, 10.0)
            woke = time.monotonic() - t0
            watch.track([])  # reaped: nothing left to watch
            t0 = time.monotonic()
            await watch.wait(stop, 0.2)
            after = time.monotonic() - t0
        finally:
            watch.close()
            child.kill()
            child.wait()
        return idle, woke, after

    idle, woke, after = asyncio.run(scenario())
    assert idle >= 0.29
    assert woke < 2.0  # the kill 0.05 s in, against a 10 s timeout
    assert after >= 0.19  # the exit was consumed: no stale wake-up


def test_a_stop_wakes_the_wait():
    async def scenario() -> float:
        watch = ExitWatch(asyncio.get_running_loop())
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        t0 = time.monotonic()
        await watch.wait(stop, 10.0)
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 2.0
