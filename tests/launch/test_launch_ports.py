"""Ports: two ``pdserve launch`` on one host (real processes, real HTTP with httpx).

The finding: a second launch (another ``--port``, the same ``--base-port``) bound the first one's
worker port while that worker was restarting; the first launcher then restarted it every 8 s
forever and its decode worker handshook with the other launch's worker. Now a launch holds its
worker ports for its whole life and checks them before it starts any worker; restarts back off
and give up with the reason in ``/health``.

On main the second launch even reports "serving": its router takes whatever answers heartbeats at
a worker address (here the first launch's worker) while its own worker loads, fails to bind and is
restarted forever; the router, decode and prefill workers now refuse a worker of another cluster."""

from __future__ import annotations

import asyncio
import errno
import io
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.harness.subprocess_server import LaunchedServer, free_base_port
from configs.schema import PdserveConfig

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2
PROMPT = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def base_port():
    return free_base_port(2)  # prefill-0 and decode-0 both: base_port + 1 must be free too


@pytest.fixture(scope="module")
def first(base_port, launched_server):
    """Launch A: PD mode, prefill-0 at ``base_port``, decode-0 at ``base_port + 1``."""
    return launched_server(
        "pd",
        "--kv-pool-tokens",
        "512",
        "--max-model-len",
        "512",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--peer-timeout-s",
        "4",
        "--log-level",
        "WARNING",
        base_port=base_port,
    )


def complete(url: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def second_launch(base_port: int) -> tuple[str, float]:
    """Launch B (colocated, its own HTTP port, A's base port): (its error output, seconds it took)."""
    srv = LaunchedServer(
        ["--mode", "colocated", "--port", "0", "--base-port", str(base_port), "--log-level", "WARNING"],
        startup_timeout_s=90,
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="exited with code 1") as e:
            srv.start()
        return str(e.value), time.monotonic() - t0
    finally:
        srv.stop()


def worker_pid(server: LaunchedServer, role: str) -> int:
    for pid in server.worker_pids():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--role" in cmd and cmd[cmd.index(b"--role") + 1] == role.encode():
            return pid
    raise LookupError(f"no {role} worker")


def wait_healthy(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while (r := httpx.get(f"{url}/health", timeout=5, trust_env=False)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)


def test_second_launch_on_taken_worker_ports_fails_at_once(first, base_port):
    err, _ = second_launch(base_port)
    # named: the busy port, the worker, the flag to change; and no worker was started for it
    assert f"control port 127.0.0.1:{base_port}" in err and "colocated-0" in err, err
    assert "choose another --base-port" in err and "e.g. --base-port" in err, err
    assert "during startup" not in err and "[colocated-0]" not in err, err
    suggested = int(re.search(r"e\.g\. --base-port (\d+)", err).group(1))
    assert suggested > base_port + 1
    complete(first.url)  # launch A never noticed


def test_worker_port_stays_held_while_its_worker_restarts(first, base_port):
    """The finding itself: while A's prefill worker restarts, nobody else can take its port, so
    the restarted worker serves there again and A's decode worker talks to it, not to B's."""
    pid = worker_pid(first, "prefill")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists():  # reaped by the launcher (it polls every 0.5 s)
        assert time.monotonic() < deadline, "the launcher did not reap its killed worker"
        time.sleep(0.05)
    with pytest.raises(OSError) as e:
        with socket.socket() as s:  # on main: free until the new worker has loaded and binds it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds (TIME_WAIT is fine)
            s.bind(("127.0.0.1", base_port))
            s.listen()
    assert e.value.errno == errno.EADDRINUSE
    err, _ = second_launch(base_port)
    assert f"control port 127.0.0.1:{base_port}" in err, err
    wait_healthy(first.url)
    assert complete(first.url)["choices"][0]["finish_reason"] == "length"
    log = first.log()
    assert "exited with code -9; restarting it in 1.0s" in log, log[-3000:]
    assert "exited with code 1" not in log, log[-3000:]  # no restart failed to bind


def _worker_children() -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"server.worker.main" in cmd:
            pids.append(int(stat.parent.name))
    return pids


def test_restarts_back_off_then_give_up_with_health_reason(caplog):
    """A worker whose every restart dies: waits 0.2, 0.4, 0.8 s between restarts, then no more
    restarts, an error log line and the reason in /health (on main: restarted every 0.5 s forever)."""
    from server.launch.launcher import Launcher, worker_argv

    cfg = PdserveConfig.model_validate(
        {
            "server": {"port": 0, "health_interval_s": HEARTBEAT_S, "log_level": "WARNING"},
            "engine": {"kv_pool_tokens": 256, "max_model_len": 256},
            "cluster": {
                "mode": "colocated",
                "base_port": free_base_port(1),
                "restart_limit": 3,
                "restart_backoff_s": 0.2,
            },
        }
    )
    starts: list[float] = []
    die = [sys.executable, "-c", "import sys; print('worker: simulated crash at start', file=sys.stderr); sys.exit(1)"]

    def argv(spec, c):
        starts.append(time.monotonic())
        return worker_argv(spec, c) if len(starts) == 1 else die

    async def scenario():
        out = io.StringIO()
        launcher = Launcher(cfg, argv=argv, out=out, install_signals=False, startup_timeout_s=240)
        run = asyncio.create_task(launcher.run())
        while "pdserve: serving" not in out.getvalue():
            assert not run.done(), "launch failed"
            await asyncio.sleep(0.2)
        url = re.search(r"at (http://\S+)", out.getvalue()).group(1)
        try:
            (pid,) = _worker_children()
            os.kill(pid, signal.SIGKILL)
            async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                deadline = time.monotonic() + 30
                while "gave up" not in (r := await client.get(f"{url}/health")).text:
                    assert time.monotonic() < deadline, f"never gave up: {r.text}; {len(starts)} starts"
                    await asyncio.sleep(0.1)
                n = len(starts)
                await asyncio.sleep(2.0)  # longer than the next back-off would be
                assert len(starts) == n, "restarted after giving up"
                return r
        finally:
            launcher.request_stop()
            assert await run == 0

    with caplog.at_level("WARNING", logger="pdserve.launch"):
        r = asyncio.run(scenario())
    assert r.status_code == 503
    assert "gave up restarting it after 3 restart(s) in a row that never got ready (last exit code 1)" in r.text
    assert len(starts) == 4  # the first start and 3 restarts
    gaps = [b - a for a, b in zip(starts[1:], starts[2:])]
    assert gaps[0] >= 0.4 and gaps[1] >= 0.8, gaps  # back-off doubles (the first wait, 0.2 s, follows the kill)
    errors = [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"]
    assert any("colocated-0" in m and "gave up restarting it" in m for m in errors), errors


def test_a_stopped_launch_drains_its_workers_and_all_exit_0(first, launched_server):
    """SIGTERM to launch A (last in this file: it ends A): its workers drain and exit by themselves,
    within the launcher's stop grace (no "did not stop ...; killing it"), and the launcher exits 0.
    Before ``server.worker.process_exit`` the interpreter's final garbage collection alone outlasted
    the grace on a busy host, so every clean drain ended in SIGKILL."""
    workers = first.worker_pids()
    launched_server.stop(first)
    log = first.log()
    assert first.proc.returncode == 0, log[-3000:]
    assert "did not stop in" not in log, log[-3000:]
    assert log.count("drained: no request held; exiting") == len(workers) == 2, log[-3000:]
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_stopping_a_launch_drains_its_workers_without_the_quiet_period():
    """The launcher stops its router first, then its workers with SIGUSR1: no router is left to see
    a drain flag, so they finish what they hold and exit without waiting 3 heartbeats for routers
    (SIGTERM, a rolling drain, still waits). Each worker exits 0 (drained), the launcher too."""
    srv = LaunchedServer(["--mode", "pd", "--port", "0", "--log-level", "WARNING"])
    srv.start()
    try:
        complete(srv.url)
        pids = srv.worker_pids()
        assert len(pids) == 2
    finally:
        rc = srv.stop()
    log = srv.log()
    assert rc == 0, log[-3000:]
    assert log.count("draining (SIGUSR1: the launcher stops the cluster)") == 2, log[-3000:]
    assert "draining (SIGTERM)" not in log and "did not stop in" not in log
