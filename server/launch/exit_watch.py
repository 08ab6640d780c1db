"""Wake the launcher's supervision the moment a worker process exits.

The supervision loop ticks every half second (restart back-off, readiness checks); an exit found
only at the next tick would leave a dead worker's streams waiting up to that long before they fail
over. ``ExitWatch`` holds a pidfd per live child (Linux 5.3+; it becomes readable when the process
exits, whatever the cause, SIGKILL included) on the event loop, and ``wait`` returns as soon as
one is readable: the exit is handled at once, not on the next tick. Without pidfds (another OS) it
only waits, and the tick finds the exit as before.

A pid is watched while its process is our unreaped child, so it cannot be reused under the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterable


class ExitWatch:
    """Readable pidfds of the watched children on ``loop``; see the module docstring. Runs on the
    loop's thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.exited = asyncio.Event()  # set when a watched child exited since the last ``wait``
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def track(self, pids: Iterable[int]) -> None:
        """Watch each of ``pids`` (live, unreaped children) not watched yet; stop watching the rest."""
        pids = set(pids)
        for pid in set(self._fds) - pids:
            self._forget(pid)
        if not hasattr(os, "pidfd_open"):
            return
        for pid in pids - set(self._fds):
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # already gone, or pidfds unsupported by this kernel: the tick finds it
                continue
            self._fds[pid] = fd
            self.loop.add_reader(fd, self._on_exit, pid)

    def _on_exit(self, pid: int) -> None:
        self._forget(pid)
        self.exited.set()

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            self.loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    async def wait(self, stop: asyncio.Event, timeout_s: float) -> None:
        """Until ``stop`` is set, a watched child exits, or ``timeout_s`` passed."""
        if not self.exited.is_set():
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.exited.wait())]
            try:
                await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        self.exited.clear()

    def close(self) -> None:
        """Stop watching every child."""
        for pid in list(self._fds):
            self._forget(pid)
