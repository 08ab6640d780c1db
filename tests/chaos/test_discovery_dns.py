"""DNS discovery across emulated hosts: router, prefill and two decode workers
each in its own network namespace (``netns_hosts``), KV over UCX/TCP between them, and a real DNS
server (dnsmasq) on the router's host answering for ``prefill.pd.test`` and ``decode.pd.test`` with
one A record per worker, as a Kubernetes headless Service does. The router runs with
``--discovery dns://prefill.pd.test:29500,dns://decode.pd.test:29500`` and no worker list.

Under a steady load: a second decode host's record appears (``kubectl scale`` up) and it gets
requests; the first one's record goes and it is drained by SIGTERM (scale down): it exits 0, no
request fails, the router is the same process throughout."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import httpx
import pytest

from bench.harness.subprocess_server import REPO_ROOT
from tests.chaos.membership_load import SteadyLoad, routed_tokens
from tests.chaos.tiny_model import save_tiny_model
from tests.support.netns_hosts import NetnsLab, running_lab, unavailable_reason
from transfer.cluster_key import ClusterKey, write_key_file

_REASON = unavailable_reason() or (
    None if shutil.which("dnsmasq") else "dnsmasq is not installed: apt-get install -y dnsmasq-base (.ci/run does)"
)
if _REASON:
    print(f"\n*** SKIPPING the DNS discovery test: {_REASON} ***", file=sys.stderr)
pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

COMMON = [
    "--page-size",
    "16",
    "--kv-pool-tokens",
    "2048",
    "--max-model-len",
    "512",
    "--health-interval-s",
    "0.3",
    "--test-step-delay-s",
    "0.01",
    "--worker-timeout-s",
    "4",
    "--peer-timeout-s",
    "4",
    "--log-level",
    "WARNING",
    "--cluster-id",
    "dns-test",
    "--drain-timeout-s",
    "60",
]
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


class Dns:
    """dnsmasq on the router host's loopback, serving the names in ``records`` (reloaded on change)."""

    def __init__(self, lab: NetnsLab, host: str, folder, records: dict[str, list[str]]) -> None:
        self.lab, self.host = lab, host
        self.hosts_file = folder / "dns-hosts"
        self.records = dict(records)
        self.write()
        ns = lab.hosts[host][0]
        with open(f"/etc/netns/{ns}/resolv.conf", "w") as f:  # bind-mounted by ip netns exec
            f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        log = folder / "dnsmasq.log"
        self.proc = lab.spawn(
            host,
            [
                "dnsmasq",
                "--no-daemon",
                "--no-resolv",
                "--no-hosts",
                "--user=root",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--local-ttl=0",
                "--log-facility=-",
                f"--addn-hosts={self.hosts_file}",
            ],
            log,
        )
        deadline = time.monotonic() + 10  # a SIGHUP before its handler is installed would end it
        while "names" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.proc.poll() is None, log.read_text()

    def write(self) -> None:
        self.hosts_file.write_text("".join(f"{ip} {name}\n" for name, ips in self.records.items() for ip in ips))

    def set(self, name: str, ips: list[str]) -> None:
        self.records[name] = ips
        self.write()
        os.kill(self.proc.pid, signal.SIGHUP)  # dnsmasq rereads --addn-hosts


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with running_lab(tmp_path_factory.mktemp("dns-logs")) as lab:
        yield lab


def _spawn(lab: NetnsLab, host: str, args: list[str]):
    env = {**os.environ, **UCX_ENV, "PYTHONPATH": str(REPO_ROOT)}
    return lab.spawn(host, [sys.executable, "-m", "server.launch.cli", *args], lab.logs / f"{host}.log", env=env)


def _logs(lab) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(lab.logs.iterdir()))


def _wait(cond, timeout_s: float, what: str, lab) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what}\n{_logs(lab)}")


def test_dns_records_add_and_remove_workers_under_load(lab, tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("dns-model"))
    ips = {name: lab.add_host(name) for name in ("r", "p", "d1", "d2")}
    dns = Dns(lab, "r", lab.logs, {"prefill.pd.test": [ips["p"]], "decode.pd.test": [ips["d1"]]})
    key = tmp_path_factory.mktemp("dns-key") / "cluster.key"  # the router and workers share it
    write_key_file(key, ClusterKey.generate())
    common = ["--model", str(model), "--cluster-key", str(key), *COMMON]
    router = _spawn(
        lab,
        "r",
        [
            "launch",
            "--mode",
            "pd",
            "--roles",
            "router",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--discovery",
            "dns://prefill.pd.test:29500,dns://decode.pd.test:29500",
            "--discovery-interval-s",
            "0.5",
            *common,
        ],
    )
    workers = {
        host: _spawn(
            lab, host, ["worker", "--role", role, "--worker-id", wid, "--control-addr", "tcp://0.0.0.0:29500", *common]
        )
        for host, role, wid in (
            ("p", "prefill", "prefill-0"),
            ("d1", "decode", "decode-1"),
            ("d2", "decode", "decode-2"),
        )
    }
    url = f"http://{ips['r']}:8000"
    _wait(lambda: httpx.get(f"{url}/health", timeout=3, trust_env=False).status_code == 200, 240, "1P+1D ready", lab)
    health = httpx.get(f"{url}/health", timeout=3, trust_env=False).json()
    assert f"decode@{ips['d1']} (decode): ready" in health["workers"] and "decode@" + ips["d2"] not in health["workers"]
    load = SteadyLoad(url).start()
    time.sleep(2)
    dns.set("decode.pd.test", [ips["d1"], ips["d2"]])  # scale up: a second record
    _wait(lambda: routed_tokens(url, f"decode@{ips['d2']}") > 0, 60, "the new decode worker gets requests", lab)
    dns.set("decode.pd.test", [ips["d2"]])  # scale down: its record goes, then the pod gets SIGTERM
    time.sleep(1)
    os.killpg(workers["d1"].pid, signal.SIGTERM)
    assert workers["d1"].wait(90) == 0, _logs(lab)
    time.sleep(2)
    outcomes = load.stop()
    print(f"\ndns scale 1D -> 2D -> 1D: {len(outcomes)} requests, {len(load.failed())} failed")
    assert load.failed() == [], load.failed()
    assert router.poll() is None
    _wait(
        lambda: f"decode@{ips['d1']}" not in httpx.get(f"{url}/health", timeout=3, trust_env=False).json()["workers"],
        20,
        "the drained worker removed",
        lab,
    )
    health = httpx.get(f"{url}/health", timeout=3, trust_env=False).json()
    assert health["status"] == "ok" and "dns://decode.pd.test:29500?role=decode: 1 address(es)" in health["discovery"]
