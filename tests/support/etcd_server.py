"""An etcd server a test starts itself (Debian's ``etcd-server``, v3 JSON gateway) on loopback ports:
start, SIGKILL, start again on the same data directory. ``etcd_binary()`` is None when it is not
installed; tests then skip naming the package to install."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from bench.harness.subprocess_server import free_port

INSTALL_HINT = "etcd is not installed: apt-get install -y etcd-server (.ci/run does)"


def etcd_binary() -> str | None:
    """The ``etcd`` executable, or None."""
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on 127.0.0.1 with its data in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"etcd-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start and wait until it answers."""
        cmd = [
            etcd_binary(),
            "--name",
            "t",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{self.peer_port}",
            "--initial-cluster",
            f"t=http://127.0.0.1:{self.peer_port}",
        ]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, timeout=1, trust_env=False).is_success:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
