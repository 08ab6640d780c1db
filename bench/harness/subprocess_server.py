"""Run ``pdserve launch`` as a child process and wait for its URL (tests, benchmarks, scripts).

The child gets its own session (process group), so ``stop()`` can make sure nothing it started
survives: SIGTERM to the launcher (which stops its workers), then SIGKILL to whatever is left in
the group after the grace period.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_URL = re.compile(r"pdserve: serving .* at (http://\S+)")
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_base_port(count: int) -> int:
    """A ``--base-port`` whose ``count`` consecutive ports could all be bound on 127.0.0.1 a moment
    ago, below Linux's ephemeral range (32768 on): ``free_port()`` + 1 and + 2 may be the next
    ``free_port()`` another part of the same test takes (an etcd peer port, a router), and
    outgoing connections draw their source ports from that range too (a chaos run once failed so)."""
    from server.launch.ports import suggest_base_port

    for _ in range(20):
        base = suggest_base_port("127.0.0.1", count, random.randrange(20000, 32000 - count))
        if base is not None and base + count <= 32768:
            return base
    raise RuntimeError(f"no {count} consecutive free ports found below 32768 on 127.0.0.1")


class LaunchedServer:
    """``pdserve launch *args`` in a child process; use as a context manager or start()/stop().

    ``url`` is set once the launcher printed its ready line. ``log()`` returns its stderr so far.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
        repo: Path | None = None,
    ) -> None:
        """``repo``: the checkout to run (default: this one), e.g. an older main for an A/B."""
        self.repo = REPO_ROOT if repo is None else Path(repo)
        self.args = list(args)
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self._lines: queue.Queue = queue.Queue()

    def start(self) -> str:
        """Start and wait for readiness; ``RuntimeError`` with the log tail if it fails or times out."""
        cmd = [sys.executable, "-m", "server.launch.cli", "launch", *self.args]
        env = self.env
        if self.repo != REPO_ROOT:  # the other checkout's modules win in the launcher and its workers
            env = {**(os.environ if env is None else env), "PYTHONPATH": str(self.repo)}
        self.proc = subprocess.Popen(
            cmd, cwd=self.repo, env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True, start_new_session=True
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None or self.proc.poll() is not None:
                raise RuntimeError(f"pdserve launch exited with code {self.proc.wait()}:\n{self.log()[-4000:]}")
            if m := _URL.search(line):
                self.url = m.group(1)
                return self.url
        self.stop()
        raise RuntimeError(f"pdserve launch not ready after {self.startup_timeout_s:.0f}s:\n{self.log()[-4000:]}")

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    @property
    def pid(self) -> int | None:
        """The launcher's pid (the process that runs the router), None before ``start()``."""
        return None if self.proc is None else self.proc.pid

    def log(self) -> str:
        """The launcher's (and its workers') stderr so far."""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def worker_pids(self) -> list[int]:
        """Pids of the launcher's direct children (its worker processes)."""
        if self.proc is None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the launcher, wait ``grace_s``, then SIGKILL its whole process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group (none if all went well)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.wait()

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- reading a launched server's /metrics --------------------------------------------------------
def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label items): value}`` from ``url``/metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric_sum(m: dict, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (e.g. over workers)."""
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def fresh_metrics(url: str, heartbeat_s: float, timeout_s: float = 15.0) -> dict:
    """Metrics whose worker series all come from heartbeats received after this call began.

    Worker series are only as new as the latest ``WorkerStats``; the router and this process share
    the monotonic clock, so ``pdserve_worker_stats_age_seconds`` below the time elapsed before the
    scrape proves freshness.
    """
    t0 = time.monotonic()
    time.sleep(2 * heartbeat_s)
    while (elapsed := time.monotonic() - t0) < timeout_s:
        m = scrape_metrics(url)
        ages = [v for (n, _), v in m.items() if n == "pdserve_worker_stats_age_seconds"]
        if ages and max(ages) < elapsed:
            return m
        time.sleep(heartbeat_s / 2)
    raise TimeoutError(f"worker stats of {url} did not refresh within {timeout_s}s")


def wait_idle(url: str, heartbeat_s: float, timeout_s: float = 30.0) -> dict:
    """Fresh metrics once no request is queued or running and no KV page is held by a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = fresh_metrics(url, heartbeat_s)
        busy = (metric_sum(m, "pdserve_kv_pool_pages", state="used"), metric_sum(m, "pdserve_queue_requests"))
        if busy == (0, 0):
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} still busy after {timeout_s}s: (used KV pages, queued+running) = {busy}")
