"""The processes of a several-routers benchmark, all on loopback, each in a process group of its own:
an etcd member, one set of workers (a workers-only ``pdserve launch --roles prefill,decode`` or
``--roles colocated``: the same thread split and core lending as a whole ``pdserve launch``), and
``routers`` routers (``pdserve launch --roles router``) that find those workers through etcd. They
share a cluster key written for the run (``transfer.cluster_key``) and a cluster id.

``RouterCluster`` is a context manager: ``__enter__`` starts everything and returns once every
router reports every worker ready; ``__exit__`` stops whatever was started, in reverse order, also
after an error or Ctrl-C (SIGTERM, then SIGKILL to the whole process group after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.harness.subprocess_server import (
    REPO_ROOT,
    LaunchedServer,
    free_base_port,
    free_port,
    metric_sum,
    scrape_metrics,
)
from transfer.cluster_key import ClusterKey, write_key_file

ETCD_HINT = "etcd is not installed: apt-get install -y etcd-server"


class StartError(RuntimeError):
    """A process of the cluster did not come up; the message carries its log tail."""


def stop_group(proc: subprocess.Popen | None, grace_s: float) -> None:
    """SIGTERM ``proc``, wait ``grace_s``, then SIGKILL its process group (it leads one) and reap."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class EtcdProcess:
    """One etcd member on 127.0.0.1 (client and peer ports free a moment ago), data in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.log_path = data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start it and wait until its JSON gateway answers; ``StartError`` otherwise."""
        binary = shutil.which("etcd")
        if binary is None:
            raise StartError(ETCD_HINT)
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            binary,
            "--name",
            "bench",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"bench={peer}",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, timeout=1, trust_env=False).is_success:
                    return
            time.sleep(0.1)
        raise StartError(f"etcd did not start: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        stop_group(self.proc, 5.0)


class WorkerLaunch:
    """A workers-only ``pdserve launch`` (no router): ready once it prints ``pdserve: workers ready``."""

    READY = "pdserve: workers ready"

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args, self.log_path = list(args), log_path
        self.proc: subprocess.Popen | None = None
        self._lines: queue.Queue = queue.Queue()

    def spawn(self) -> None:
        """Start it (``wait_ready`` waits for its workers)."""
        cmd = [sys.executable, "-m", "server.launch.cli", "launch", *self.args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
            )
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for its ready line; ``StartError`` with its log tail if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                line = self._lines.get(timeout=0.5)
                if line is None:
                    break
                if line.startswith(self.READY):
                    return
        raise StartError(f"the workers' launch is not ready (exit code {self.proc.poll()}):\n{self.log()[-4000:]}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_group(self.proc, 20.0)


@dataclass(frozen=True)
class ClusterSpec:
    """What to start: ``prefill`` + ``decode`` PD workers, or ``colocated`` replicas when > 0;
    ``routers`` routers; ``engine_flags`` go to the workers and the routers (``--model``, ``--dtype``,
    ``--kv-pool-tokens``, ...)."""

    prefill: int = 1
    decode: int = 2
    colocated: int = 0
    routers: int = 2
    engine_flags: tuple[str, ...] = ()
    heartbeat_s: float = 1.0
    startup_timeout_s: float = 600.0

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "pd"

    @property
    def worker_role(self) -> str:
        """The role whose load spread the benchmark reports (decode, or colocated)."""
        return "colocated" if self.colocated else "decode"

    def worker_ids(self) -> list[str]:
        """Every worker's id, as ``server.launch.roles.worker_specs`` names them."""
        if self.colocated:
            return [f"colocated-{i}" for i in range(self.colocated)]
        return [f"prefill-{i}" for i in range(self.prefill)] + [f"decode-{j}" for j in range(self.decode)]

    def spread_ids(self) -> list[str]:
        return [w for w in self.worker_ids() if w.startswith(self.worker_role)]

    def workers_argv(self, common: list[str]) -> list[str]:
        counts = (
            ["--replicas", str(self.colocated), "--roles", "colocated"]
            if self.colocated
            else ["--prefill", str(self.prefill), "--decode", str(self.decode), "--roles", "prefill,decode"]
        )
        n = self.colocated or self.prefill + self.decode
        return ["--mode", self.mode, *counts, "--base-port", str(free_base_port(n)), *common]


@dataclass
class RouterCluster:
    """Everything of one run (see the module docstring); ``urls``: the routers, once entered."""

    spec: ClusterSpec
    workdir: Path | None = None
    urls: list[str] = field(default_factory=list)
    etcd: EtcdProcess | None = None
    prefix: str = "/bench-routers/"

    def __post_init__(self) -> None:
        self._tmp = None
        self._stack = contextlib.ExitStack()
        self.routers: list[LaunchedServer] = []

    def __enter__(self) -> RouterCluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _start(self) -> None:
        if self.workdir is None:
            self._tmp = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-two-routers-"))
            self.workdir = Path(self._tmp)
        s, work = self.spec, self.workdir
        self.etcd = EtcdProcess(work / "etcd-data")
        self._stack.callback(self.etcd.stop)
        self.etcd.start()
        key = work / "cluster.key"
        write_key_file(key, ClusterKey.generate(), overwrite=True)
        common = [
            "--cluster-id",
            f"two-routers-{os.getpid()}",
            "--cluster-key",
            str(key),
            "--discovery",
            f"etcd://127.0.0.1:{self.etcd.port}{self.prefix}",
            "--health-interval-s",
            str(s.heartbeat_s),
            "--log-level",
            "WARNING",
            *s.engine_flags,
        ]
        self._workers = workers = WorkerLaunch(s.workers_argv(common), work / "workers.log")
        self._stack.callback(workers.stop)
        workers.spawn()  # the routers start meanwhile: a discovery router is up before any worker is
        for _ in range(s.routers):
            r = LaunchedServer(
                ["--mode", s.mode, "--roles", "router", "--port", "0", *common], startup_timeout_s=s.startup_timeout_s
            )
            self._stack.callback(r.stop)
            r.start()
            self.routers.append(r)
        workers.wait_ready(s.startup_timeout_s)
        self.urls = [r.url for r in self.routers]
        for url in self.urls:
            self._wait_all_ready(url, s.startup_timeout_s)

    def _wait_all_ready(self, url: str, timeout_s: float) -> None:
        """Until the router at ``url`` reports every worker up (``pdserve_worker_up``)."""
        want, deadline, up = set(self.spec.worker_ids()), time.monotonic() + timeout_s, set()
        while time.monotonic() < deadline:
            m = scrape_metrics(url)
            up = {w for w in want if metric_sum(m, "pdserve_worker_up", worker=w) == 1.0}
            if up == want:
                return
            time.sleep(0.3)
        raise StartError(
            f"router {url} sees {sorted(up)} ready of {sorted(want)} after {timeout_s:.0f}s; "
            f"its /health: {httpx.get(url + '/health', trust_env=False, timeout=10).text[:1000]}"
        )

    def processes(self) -> dict[str, int]:
        """Pid by name of every router (``router-a``, ``router-b``, ...) and worker (its id)."""
        from bench.serve.cpu import ROUTER, server_processes

        out = {f"router-{chr(ord('a') + i)}": r.pid for i, r in enumerate(self.routers)}
        out.update({n: pid for n, pid in server_processes(self._workers.proc.pid).items() if n != ROUTER})
        return out

    def router_tags(self) -> list[int]:
        """The room tags the routers claimed in etcd (keys ``{prefix}routers/{tag}``), sorted."""
        from server.discovery.etcd import EtcdClient

        client = EtcdClient(self.etcd.url)
        try:
            keys = client.get_prefix(f"{self.prefix}routers/")[1]
        finally:
            client.close()
        return sorted(int(k.rsplit("/", 1)[1]) for k in keys)
