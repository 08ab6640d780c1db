"""``docker/compose.yaml`` brought up as a throw-away project for tests: its own project name,
subnet and loopback port; ``down -v`` removes every container, network and volume of it.

Only the router's published port on 127.0.0.1 is ever connected to. Before that, every
container's address is checked to be routed through the project's own bridge.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from transfer.cluster_key import ClusterKey, write_key_file

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "compose.yaml"


def sh(*cmd: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> str:
    """Run ``cmd``; its stdout. ``RuntimeError`` with stderr when it fails and ``check``."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout


def free_subnet() -> str:
    """A /24 in 10.214.200-249 that neither a route nor a Docker network uses."""
    used = sh("ip", "-4", "route", "show")
    for net_id in sh("docker", "network", "ls", "-q").split():
        info = json.loads(sh("docker", "network", "inspect", net_id))[0]
        used += " ".join(c.get("Subnet", "") for c in (info.get("IPAM", {}).get("Config") or []))
    for i in range(200, 250):
        net = ipaddress.ip_network(f"10.214.{i}.0/24")
        if f"10.214.{i}." not in used:
            return str(net)
    raise RuntimeError("no free subnet in 10.214.200.0-10.214.249.0")


class ComposeStack:
    """One project of ``docker/compose.yaml`` plus an override file written by the test."""

    def __init__(self, override: str, port: int, port_b: int, tmp: Path) -> None:
        self.project = f"pdtest{os.getpid()}"
        self.port = port
        self.url = f"http://127.0.0.1:{port}"  # service router
        self.url_b = f"http://127.0.0.1:{port_b}"  # service router-b, in front of the same workers
        self.subnet = free_subnet()
        self.override = tmp / "override.yaml"
        self.override.write_text(override)
        key = tmp / "cluster.key"  # the compose secret: a fresh cluster key, readable by the image's user only
        write_key_file(key, ClusterKey.generate())
        os.chown(key, 10001, 10001)
        self.env = {
            **os.environ,
            "PDSERVE_PORT": str(port),
            "PDSERVE_PORT_B": str(port_b),
            "PDSERVE_SUBNET": self.subnet,
            "PDSERVE_CLUSTER_KEY_FILE": str(key),
        }

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> str:
        return sh(
            "docker-compose",
            "-p",
            self.project,
            "-f",
            str(COMPOSE),
            "-f",
            str(self.override),
            *args,
            check=check,
            timeout=timeout,
            env=self.env,
        )

    def up(self) -> None:
        """``up -d``: returns once the workers are healthy and the router container started."""
        self.compose("up", "-d", "--no-build")

    def down(self) -> None:
        """``down -v``: every container, the network and the named volume of the project."""
        self.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=180)

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        return (
            sh("docker", "ps", "-aq", "--filter", label).split()
            + sh("docker", "network", "ls", "-q", "--filter", label).split()
            + sh("docker", "volume", "ls", "-q", "--filter", label).split()
        )

    def containers(self, service: str) -> list[dict]:
        """``docker inspect`` of every replica of ``service``, oldest replica first."""
        cids = self.compose("ps", "-q", service).split()
        assert cids, f"no container for {service}"
        infos = json.loads(sh("docker", "inspect", *cids))
        return sorted(
            infos, key=lambda i: i["Config"]["Labels"].get("com.docker.compose.container-number", "0").zfill(4)
        )

    def container(self, service: str) -> dict:
        """``docker inspect`` of the one container of ``service``."""
        (info,) = self.containers(service)
        return info

    def inspect(self, cid: str) -> dict:
        return json.loads(sh("docker", "inspect", cid))[0]

    @staticmethod
    def address(info: dict) -> str:
        """The container's address on the project network (the one network it is on)."""
        (net,) = info["NetworkSettings"]["Networks"].values()
        return net["IPAddress"]

    def verify_routes(self, services: list[str]) -> None:
        """Each container's address is routed via the project network's bridge (nothing else)."""
        for s in services:
            for info in self.containers(s):
                (net,) = info["NetworkSettings"]["Networks"].values()
                addr = net["IPAddress"]
                assert ipaddress.ip_address(addr) in ipaddress.ip_network(self.subnet), (s, addr, self.subnet)
                out = sh("ip", "-o", "route", "get", addr).split()
                assert out[out.index("dev") + 1] == "br-" + net["NetworkID"][:12], f"{s} ({addr}): {' '.join(out)}"

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False)[-8000:]

    def wait_healthy(self, timeout_s: float = 300, url: str | None = None, listing: str = "") -> float:
        """Seconds until the router at ``url`` (default: service router) answered /health with 200
        and, when ``listing`` is given, its ``workers`` text contains it."""
        url = url or self.url
        t0 = time.monotonic()
        last = ""
        while True:
            try:
                r = httpx.get(f"{url}/health", timeout=5, trust_env=False)
                last = r.text
                if r.status_code == 200 and listing in r.json().get("workers", ""):
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"router {url} not healthy{f' with {listing!r}' if listing else ''} after "
                    f"{timeout_s}s: {last[:500]}\n{self.logs()}"
                )
            time.sleep(0.5)
