"""Emulated hosts for tests: network namespaces on one dedicated private /24, joined by a bridge.

Topology (every name carries this run's tag, so nothing collides with other runs or users):

    root ns (the test, .1) --veth--+
    ns <tag>-r  (host "r", .2) ----+-- bridge in its own hub namespace <tag>-hub
    ns <tag>-p  (host "p", .3) ----+
    ...

The bridge lives in a hub namespace rather than the root one, so the root namespace's firewall
(Docker sets FORWARD to DROP and br_netfilter sends bridged frames through it) never sees the
traffic. Hosts have no default route: an address outside the subnet is unreachable from them.
Each host gets its own ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/NS/hosts``), which
plays the part of cluster DNS; :meth:`NetnsLab.set_name` rewrites it in place (the bind mount
follows the inode), so a name can move to another host.

:meth:`NetnsLab.close` kills every process started through :meth:`spawn` and removes every
namespace, veth, bridge and hosts file; it runs on failure too and can be called twice.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNETS = [ipaddress.ip_network(f"10.214.{i}.0/24") for i in range(14, 30)]


def run(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    """Run ``cmd`` (inside namespace ``ns`` if given) and return its stdout."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "network-namespace test needs root (ip netns add); run make test as root"
    if shutil.which("ip") is None:
        return "network-namespace test needs the 'ip' tool (apt-get install iproute2)"
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """The first of ``SUBNETS`` that no route or address on this host covers yet.

    A subnet is free when ``ip route get`` of its addresses answers with the default route (no
    more specific route exists) and no interface has an address in it.
    """
    addrs = run("ip", "-o", "-4", "addr", "show")
    for net in SUBNETS:
        prefix = ".".join(str(net.network_address).split(".")[:3]) + "."
        if prefix in addrs:
            continue
        routes = run("ip", "-4", "route", "show", "match", str(net.network_address))
        if all(line.startswith("default") for line in routes.splitlines() if line.strip()):
            return net
    raise RuntimeError(f"no free test subnet among {SUBNETS[0]} .. {SUBNETS[-1]}")


class NetnsLab:
    """Namespaced hosts on one bridge; see the module docstring."""

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or f"pdt{os.getpid() % 100000}"
        self.net = free_subnet()
        self.hub = f"{self.tag}-hub"
        self.hosts: dict[str, tuple[str, str]] = {}  # name -> (namespace, ip)
        self.names: dict[str, str] = {}  # DNS name -> ip, written to every host's /etc/hosts
        self.procs: list[subprocess.Popen] = []
        self.unplugged: set[str] = set()
        self._root_if = f"{self.tag}r0"
        self._created: list[str] = []
        self._next = 2

    def ip(self, n: int) -> str:
        """The ``n``-th address of the subnet."""
        return str(self.net.network_address + n)

    # ---- topology ----------------------------------------------------------------------------
    def start(self) -> None:
        """Create the hub with its bridge and the root namespace's port (address .1)."""
        self._add_ns(self.hub)
        run("ip", "link", "add", "br0", "type", "bridge", ns=self.hub)
        run("ip", "link", "set", "br0", "up", ns=self.hub)
        run("ip", "link", "add", self._root_if, "type", "veth", "peer", "name", "hubroot", "netns", self.hub)
        run("ip", "link", "set", "hubroot", "master", "br0", "up", ns=self.hub)
        run("ip", "addr", "add", f"{self.ip(1)}/24", "dev", self._root_if)
        run("ip", "link", "set", self._root_if, "up")

    def add_host(self, name: str) -> str:
        """A new namespace ``<tag>-<name>`` wired to the bridge; returns its address."""
        ns, addr = f"{self.tag}-{name}", self.ip(self._next)
        self._next += 1
        self._add_ns(ns)
        Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{ns}/hosts").write_text(self._hosts_text())
        port = f"hub{name}"[:15]
        run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.hub)
        run("ip", "link", "set", port, "master", "br0", "up", ns=self.hub)
        run("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        run("ip", "link", "set", "eth0", "up", ns=ns)
        run("ip", "link", "set", "lo", "up", ns=ns)
        self.hosts[name] = (ns, addr)
        return addr

    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self._created.append(ns)

    def set_name(self, dns_name: str, addr: str | None) -> None:
        """Point ``dns_name`` at ``addr`` (None: remove it) in every host's /etc/hosts."""
        if addr is None:
            self.names.pop(dns_name, None)
        else:
            self.names[dns_name] = addr
        text = self._hosts_text()
        for ns, _ in self.hosts.values():
            with open(f"/etc/netns/{ns}/hosts", "w") as f:  # in place: the bind mount follows the inode
                f.write(text)

    def _hosts_text(self) -> str:
        return "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.names.items())

    # ---- checks ------------------------------------------------------------------------------
    def route_dev(self, dst: str, ns: str | None = None) -> str:
        """The device ``ip route get dst`` picks (inside ``ns``); raises if there is no route."""
        out = run("ip", "-o", "route", "get", dst, ns=ns).split()
        return out[out.index("dev") + 1]

    def verify_routes(self) -> None:
        """Every plugged-in host reaches every other over its eth0 and the root ns over its port; no
        host has a default route. Raises ``AssertionError`` naming the first wrong route."""
        live = {n: h for n, h in self.hosts.items() if n not in self.unplugged}
        for name, (ns, _) in live.items():
            assert "default" not in run("ip", "route", "show", ns=ns), f"host {name} has a default route"
            for other, (_, addr) in live.items():
                if other != name:
                    assert self.route_dev(addr, ns) == "eth0", f"{name} -> {other} ({addr}) not via eth0"
            assert self.route_dev(self.ip(1), ns) == "eth0"
        for name, (_, addr) in live.items():
            dev = self.route_dev(addr)
            assert dev == self._root_if, f"root -> {name} ({addr}) goes via {dev}, not the test's veth"

    def unplug(self, name: str) -> None:
        """Take host ``name``'s link down: from now on it sends nothing and answers nothing."""
        run("ip", "link", "set", "eth0", "down", ns=self.hosts[name][0])
        self.unplugged.add(name)

    def tx_bytes(self, name: str) -> int:
        """Bytes sent so far by host ``name``'s eth0."""
        ns, _ = self.hosts[name]
        return int(run("cat", "/sys/class/net/eth0/statistics/tx_bytes", ns=ns))

    # ---- processes ---------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` inside host ``name`` (its own process group), stdout+stderr to ``log``."""
        ns, _ = self.hosts[name]
        with open(log, "ab") as f:
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv], stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append(p)
        return p

    def kill(self, p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal ``p``'s process group (it runs in its own session) and reap it."""
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            p.wait(20)

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every spawned process (SIGTERM to all at once, SIGKILL to what is left after
        ``grace_s``), delete every namespace (their veths go with them), the root port and the
        hosts files. Safe to call more than once."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(p)
        self.procs.clear()
        for ns in reversed(self._created):
            run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._created.clear()
        run("ip", "link", "del", self._root_if, check=False)  # gone with the hub already; belt and braces
        time.sleep(0.1)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this lab that still exist (empty after a clean ``close``)."""
        left = [ns for ns in run("ip", "netns", "list").split() if ns.startswith(self.tag + "-")]
        if self._root_if in run("ip", "-o", "link", "show"):
            left.append(self._root_if)
        left += [d.name for d in Path("/etc/netns").glob(f"{self.tag}-*")] if Path("/etc/netns").exists() else []
        return left


@contextlib.contextmanager
def running_lab(logs: Path, **attrs):
    """A started ``NetnsLab`` logging under ``logs`` (``attrs`` set on it first); closed on exit, and
    asserted to leave no namespace, link or process behind."""
    lab = NetnsLab()
    lab.logs = logs
    for name, value in attrs.items():
        setattr(lab, name, value)
    try:
        lab.start()
        yield lab
    finally:
        lab.close()
        assert lab.leftovers() == [], f"left behind: {lab.leftovers()}"
