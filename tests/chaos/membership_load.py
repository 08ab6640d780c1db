"""A router whose workers come from etcd, workers the test starts and stops one by one
(``pdserve worker``), and a steady streamed load that records every request's outcome: the parts
of the membership tests."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from bench.harness.subprocess_server import REPO_ROOT, free_port, scrape_metrics
from tests.support.stream_client import Outcome, stream_one


class WorkerProc:
    """One ``pdserve worker`` process on 127.0.0.1 (started by the test, registered in discovery)."""

    def __init__(self, role: str, worker_id: str, args: list[str]) -> None:
        self.role, self.worker_id = role, worker_id
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.log = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            "-m",
            "server.launch.cli",
            "worker",
            "--role",
            role,
            "--worker-id",
            worker_id,
            "--control-addr",
            self.addr,
            *args,
        ]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=self.log)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def routed_tokens(url: str, worker_id: str) -> float:
    """Prompt tokens the worker accepted, from the router's ``/metrics`` (0 before its first request)."""
    m = scrape_metrics(url)
    return sum(
        v for (n, lab), v in m.items() if n == "pdserve_prompt_tokens_total" and dict(lab)["worker"] == worker_id
    )


def first_routed_after_start(url: str, w: WorkerProc, registered, timeout_s: float = 180.0) -> tuple[float, float]:
    """(seconds from the worker's process start to its key in etcd, to the router's first request on
    it), polled every 0.1 s; ``registered()`` tells whether its key is there."""
    deadline = time.monotonic() + timeout_s
    t_reg = None
    while time.monotonic() < deadline:
        if t_reg is None and registered():
            t_reg = time.monotonic() - w.started
        if routed_tokens(url, w.worker_id) > 0:
            return t_reg if t_reg is not None else float("nan"), time.monotonic() - w.started
        if w.proc.poll() is not None:
            raise RuntimeError(f"{w.worker_id} exited with {w.proc.returncode}:\n{w.output()[-3000:]}")
        time.sleep(0.1)
    raise TimeoutError(f"{w.worker_id} got no request within {timeout_s}s")


class SteadyLoad:
    """``clients`` streams in a loop against ``url`` on a thread until ``stop()``; every outcome kept."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 16) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    async def _client(self, http: httpx.AsyncClient, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            prompt = f"client {k} request {i}: " + "river stone light garden " * (1 + (i + k) % 4)
            self.outcomes.append(await stream_one(http, prompt, self.max_tokens, k * 10000 + i))
            i += 1

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120, trust_env=False) as http:
            await asyncio.gather(*(self._client(http, k) for k in range(self.clients)))

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(180)
        return self.outcomes

    def failed(self) -> list[tuple]:
        return [
            (o.prompt, o.status, o.error)
            for o in self.outcomes
            if o.status != 200 or o.error or len(o.tokens) != self.max_tokens
        ]
