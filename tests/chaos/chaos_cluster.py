"""A launched PD cluster for chaos and soak runs, and the client side of a load against it.

``Cluster``: ``pdserve launch --mode pd`` (router + local workers, real processes, loopback only)
plus, optionally, one decode worker run by the test itself (``pdserve worker``) that the router
reaches as a remote worker, so a test can restart it with other flags (another page size). Helpers
find a worker's pid by its id, read the router's ``/metrics`` and wait for full recovery: every
worker ready, no request queued, no KV page used, the host pool empty.

``stream_one``: one streamed ``/v1/completions`` request over httpx, recorded as an ``Outcome``
(tokens, HTTP status, error message, when it ended). ``run_load``: many of them at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness.subprocess_server import (
    REPO_ROOT,
    LaunchedServer,
    free_base_port,
    free_port,
    metric_sum,
    scrape_metrics,
    wait_idle,
)
from tests.support.stream_client import Outcome, stream_one
from transfer.cluster_key import ClusterKey, write_key_file

HEARTBEAT_S = 0.2


async def run_load(
    url: str, prompts: list[tuple[str, int]], started: asyncio.Event | None = None, timeout_s: float = 120.0
) -> list[Outcome]:
    """Every ``(prompt, max_tokens)`` at once, one connection each; ``started`` is set once all went out."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, trust_env=False) as c:
        tasks = [asyncio.create_task(stream_one(c, p, n, i)) for i, (p, n) in enumerate(prompts)]
        if started is not None:
            started.set()
        return await asyncio.gather(*tasks)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` from ``/proc/PID/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for pid {pid}")


class ExternalDecode:
    """A decode worker this test runs itself (``pdserve worker``), routed to as a remote worker."""

    def __init__(self, args: list[str], avoid: range, worker_id: str = "decode-x") -> None:
        """``avoid``: ports the launcher's workers will bind."""
        self.args, self.worker_id = list(args), worker_id
        port = free_port()
        while port in avoid:
            port = free_port()
        self.addr = f"tcp://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def start(self, *extra: str) -> None:
        """Start (again) with the cluster's flags plus ``extra`` (later flags win)."""
        cmd = [
            sys.executable,
            "-m",
            "server.launch.cli",
            "worker",
            "--role",
            "decode",
            "--worker-id",
            self.worker_id,
            "--control-addr",
            self.addr,
            *self.args,
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=self.log)

    def kill(self) -> None:
        """SIGKILL and reap (no-op if not running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


class Cluster:
    """``pdserve launch --mode pd`` with ``prefill`` + ``decode`` local workers (+ one external decode)."""

    def __init__(
        self, model_dir: Path, prefill: int, decode: int, args: list[str], external: list[str] | None = None
    ) -> None:
        """``external``: run one more decode worker with these flags on top of the cluster's."""
        self._key_dir = tempfile.TemporaryDirectory()  # the launch and the external worker share a key file
        key = Path(self._key_dir.name) / "cluster.key"
        write_key_file(key, ClusterKey.generate())
        common = [
            "--model",
            str(model_dir),
            "--health-interval-s",
            str(HEARTBEAT_S),
            "--cluster-id",
            f"chaos-{os.getpid()}",
            "--cluster-key",
            str(key),
            "--log-level",
            "WARNING",
            *args,
        ]
        base = free_base_port(prefill + decode)
        ports = range(base, base + prefill + decode)
        self.external = ExternalDecode(common + external, ports) if external is not None else None
        remote = ["--worker", f"decode={self.external.worker_id}={self.external.addr}"] if self.external else []
        # least-loaded: the fault tests know their victim's route from its tie order (an idle router
        # sends to prefill-0 + decode-0); cache-aware routing would follow the prompts' cached pages
        self.server = LaunchedServer(
            [
                "--mode",
                "pd",
                "--prefill",
                str(prefill),
                "--decode",
                str(decode),
                "--port",
                "0",
                "--base-port",
                str(base),
                "--routing",
                "least-loaded",
                *common,
                *remote,
            ]
        )

    def start(self) -> str:
        """Start everything; the URL once ``/health`` is 200 (every worker ready)."""
        if self.external is not None:
            self.external.start()
        try:
            return self.server.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.server.stop()
        if self.external is not None:
            self.external.kill()

    @property
    def url(self) -> str:
        return self.server.url

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the launcher's (and its workers') log and of the external worker's."""
        text = f"--- launcher and its workers ---\n{self.server.log()[-chars:]}"
        if self.external is not None:
            fd = self.external.log.fileno()  # pread: the worker writes through the same file offset
            tail = os.pread(fd, chars, max(0, os.fstat(fd).st_size - chars)).decode(errors="replace")
            text += f"\n--- {self.external.worker_id} ---\n{tail}"
        return text

    @property
    def router_pid(self) -> int:
        """The launcher process, which runs the router."""
        return self.server.proc.pid

    def pid(self, worker_id: str) -> int:
        """The pid of the current process of ``worker_id``."""
        if self.external is not None and worker_id == self.external.worker_id:
            return self.external.proc.pid
        for pid in self.server.worker_pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--worker-id" in cmd and cmd[cmd.index(b"--worker-id") + 1] == worker_id.encode():
                return pid
        raise LookupError(f"no process for worker {worker_id}")

    def worker_ids(self, role: str) -> list[str]:
        """Ids of the workers of ``role`` the router knows (from ``pdserve_worker_up``)."""
        m = scrape_metrics(self.url)
        return sorted(dict(lab)["worker"] for (n, lab) in m if n == "pdserve_worker_up" and dict(lab)["role"] == role)

    def metrics(self) -> dict:
        return scrape_metrics(self.url)

    def counter(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics(), name, **labels)

    def wait_recovered(self, timeout_s: float = 90.0) -> dict:
        """Fresh metrics once every worker is ready, nothing is queued and no KV page or host pool
        byte is held; ``TimeoutError`` naming what is not back."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = httpx.get(f"{self.url}/health", timeout=5, trust_env=False)
            if h.status_code == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {h.json()['workers']}")
            time.sleep(0.25)
        m = wait_idle(self.url, HEARTBEAT_S, timeout_s=max(5.0, deadline - time.monotonic()))
        while (host := metric_sum(m, "pdserve_host_kv_pool_bytes", state="used")) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the host pool still holds {host:g} bytes after {timeout_s:.0f}s")
            m = wait_idle(self.url, HEARTBEAT_S, timeout_s=30)
        return m


def running(cluster: Cluster):
    """For a module fixture (``yield from running(Cluster(...))``): the cluster started, stopped after."""
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def leaks(m: dict) -> tuple[float, float]:
    """(KV pages used on every worker, host pool bytes used) in ``m``."""
    return (
        metric_sum(m, "pdserve_kv_pool_pages", state="used"),
        metric_sum(m, "pdserve_host_kv_pool_bytes", state="used"),
    )


def signal_worker(cluster: Cluster, worker_id: str, sig: signal.Signals) -> int:
    """Send ``sig`` to the worker's current process; returns its pid."""
    pid = cluster.pid(worker_id)
    os.kill(pid, sig)
    return pid
