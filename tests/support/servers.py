"""Launched servers for tests: ``ServerFactory`` (what the ``launched_server`` fixtures hand out) and
the flags of the shared default PD launch (``pd_server``, tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from bench.harness.subprocess_server import LaunchedServer, free_base_port


# ---- launched servers ---------------------------------------------------------------------------
class ServerFactory:
    """``factory(mode, *flags, base_port=None, env=None, startup_timeout_s=240.0)``: start
    ``pdserve launch --mode MODE --port 0 --base-port PORT *flags`` (PORT: a free one unless given)
    and return the ready ``LaunchedServer``. Every server it started is stopped by ``close()``
    (the fixture's teardown), also when its start failed; ``stop(srv)`` stops one earlier.
    """

    def __init__(self) -> None:
        self.running: list[LaunchedServer] = []

    def __call__(
        self,
        mode: str,
        *flags: str,
        base_port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
    ) -> LaunchedServer:
        port = free_base_port(8) if base_port is None else base_port
        srv = LaunchedServer(
            ["--mode", mode, "--port", "0", "--base-port", str(port), *flags],
            env=env,
            startup_timeout_s=startup_timeout_s,
        )
        self.running.append(srv)
        srv.start()
        return srv

    def stop(self, srv: LaunchedServer) -> None:
        self.running.remove(srv)
        srv.stop()

    def close(self) -> None:
        while self.running:
            self.running.pop().stop()


def worker_pid(server: LaunchedServer, worker_id: str) -> int:
    """The pid of the launched ``server``'s current process of ``worker_id`` (``--worker-id`` on its
    command line); ``LookupError`` when it runs none."""
    for pid in server.worker_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # exited since the listing
            continue
        if b"--worker-id" in cmd and cmd[cmd.index(b"--worker-id") + 1] == worker_id.encode():
            return pid
    raise LookupError(f"no process for worker {worker_id}")


# The shared default PD launch (``pd_server``): its heartbeat (for ``wait_idle``) and flags.
PD_SERVER_HEARTBEAT_S = 0.2
PD_SERVER_FLAGS = (
    "--kv-pool-tokens",
    "1024",
    "--health-interval-s",
    str(PD_SERVER_HEARTBEAT_S),
    "--worker-timeout-s",
    "30",
    "--log-level",
    "INFO",
)
