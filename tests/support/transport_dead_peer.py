"""The dead-peer transport scenario, run in a child Python process of its own.

``python -m tests.support.transport_dead_peer BACKEND OPTS_JSON LIMIT_S`` (from the repository
root) runs ``scenario`` and exits 0
when every assertion holds, 1 (with the traceback on stderr) when one fails. A native crash in
the data plane (ucxx has segfaulted in ``tag_send`` to a killed peer) kills only this process:
``run_child`` reports it as the child's signal and stderr tail instead of taking pytest down.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.transport_peers import check, reap, spawn_target, spawn_targets
from tests.support.transport_pools import PAGE_BYTES, make_pool
from transfer.factory import create_transport

ROOT = Path(__file__).resolve().parents[2]  # the repository: the child imports tests.support modules


def scenario(backend: str, opts: dict, limit_s: float) -> None:
    """kill -9 of a warm target and of a cold one (never written to): a write to each ends
    ``"error"`` within ``limit_s``, never hangs; the removed cold peer is unknown afterwards; the
    target restarted under the same name works again (pages and notif checked by the target)."""
    ctx = mp.get_context("spawn")
    # the pipes stay referenced: a target whose pipe closes exits (EOFError) before it is killed
    # dec3 dies before any write reaches it
    (p, _conn, md), (pc, _conn_c, mdc) = spawn_targets(ctx, backend, [f"{backend}-dec2", f"{backend}-dec3"], opts)
    p2 = None
    t = create_transport(backend, f"{backend}-pre2", **opts)
    try:
        t.register_pool(make_pool(fill=True), PAGE_BYTES)
        peer = t.add_peer(md)
        cold_peer = t.add_peer(mdc)
        h = t.write_pages(peer, [1, 2], [3, 4], b"warm")
        assert h.wait(10) == "done", h.error

        for proc, name in ((p, peer), (pc, cold_peer)):
            proc.kill()
            proc.join(5)
            t0 = time.monotonic()
            h = t.write_pages(name, [5, 6, 7], [8, 9, 10], b"to-the-dead")
            state = h.wait(limit_s + 5)
            took = time.monotonic() - t0
            assert state == "error", f"write to killed {name} ended {state!r} after {took:.2f}s"
            assert h.error and took < limit_s, (h.error, took)
            h.release()
        t.remove_peer(cold_peer)
        assert t.peers() == [peer]
        with pytest.raises(ValueError, match="unknown peer"):
            t.write_pages(cold_peer, [0], [0], b"x")

        # The decode worker comes back under the same name: new metadata replaces the old peer.
        p2, conn2, md2 = spawn_target(ctx, backend, f"{backend}-dec2", opts)
        assert md2 != md
        assert t.add_peer(md2) == peer
        h = t.write_pages(peer, [5, 6, 7], [8, 9, 10], b"again")
        assert h.wait(10) == "done", h.error
        rep = check(conn2, [5, 6, 7], [8, 9, 10], 1)
        assert rep["bad_pages"] == [] and rep["notifs"] == [(f"{backend}-pre2", b"again")]
        conn2.send(("bye",))
        p2.join(10)
    finally:
        t.close()
        reap(p)
        reap(pc)
        if p2 is not None:
            reap(p2)


@dataclass(frozen=True)
class ChildResult:
    """How one child run ended: ``returncode`` (negative: killed by that signal; None: timed out,
    its process group killed) and the tail of its stderr."""

    returncode: int | None
    stderr_tail: str

    @property
    def crashed(self) -> bool:
        """Killed by a signal (a native crash), as opposed to exiting or timing out."""
        return self.returncode is not None and self.returncode < 0

    def describe(self) -> str:
        """One line for a test failure: how the child ended, then its stderr tail."""
        if self.returncode is None:
            how = "timed out (process group killed)"
        elif self.crashed:
            how = f"killed by {signal.Signals(-self.returncode).name}"
        else:
            how = f"exited {self.returncode}"
        return f"dead-peer child {how}; stderr tail:\n{self.stderr_tail}"


def run_python(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> ChildResult:
    """Run ``python -X faulthandler *args`` (this environment plus ``env``, in the repository root)
    in a fresh process in its own session and say how it ended; stderr keeps its last 4000
    characters (faulthandler's Python stack on a crash, the traceback on an assertion). Past
    ``timeout_s`` the child gets SIGABRT (faulthandler prints where it hung), then its whole
    process group SIGKILL, and the result says it timed out."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # none left: nothing to kill
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own processes too
        _, err = proc.communicate()
        code = None
    return ChildResult(code, (err or "")[-4000:])


def run_child(
    backend: str, opts: dict, limit_s: float, env: dict[str, str] | None = None, timeout_s: float = 240.0
) -> ChildResult:
    """``scenario(backend, opts, limit_s)`` in a child process (``run_python`` of this module, with
    ``env`` added to its environment)."""
    args = ["-m", "tests.support.transport_dead_peer", backend, json.dumps(opts), repr(float(limit_s))]
    return run_python(args, timeout_s, env)


def main(argv: list[str]) -> int:
    """``BACKEND OPTS_JSON LIMIT_S``: run the scenario; 0 when it passes (failures raise)."""
    backend, opts, limit_s = argv[0], json.loads(argv[1]), float(argv[2])
    scenario(backend, opts, limit_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
