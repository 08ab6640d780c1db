"""``pdserve launch``: start the worker process(es) and the router, serve until SIGINT/SIGTERM.

Steps: bind the HTTP socket and every local worker's control port (a busy port fails at once,
naming the port and the flag to change; the launcher holds the worker ports for the whole launch,
see ``server.launch.ports``), spawn one process per worker (``python -m server.worker.main`` serving on
its inherited port), load the tokenizer, start uvicorn with the router app in this
process, wait until ``GET /health`` answers 200, then print ``pdserve: serving MODEL at URL`` on
stdout. A worker that exits during startup makes the launch fail (exit code 1, message on stderr,
the worker's own log above it). After startup a worker that exits is marked dead at once (its
requests fail with 503, ``/health`` says why) and, with ``restart_workers``, started again after
an exponential back-off, up to ``restart_limit`` times in a row (``server.launch.supervisor``); the new
process rejoins through heartbeats (a new ``instance`` id) and serves again. A launch that runs
the router and all its workers gets a random ``cluster_id`` (unless configured): its router and
workers refuse any worker of another deployment that answers at one of their addresses; the same
launch makes an ephemeral cluster key for its control plane (``server.launch.launch_auth``).

Children never outlive the launcher: they ignore SIGINT (Ctrl-C in a terminal reaches the whole
process group; the launcher stops them itself), get SIGTERM from the kernel if the launcher dies
(``PR_SET_PDEATHSIG``), and are SIGTERMed, then SIGKILLed after a grace period, on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import TextIO

import httpx
import uvicorn
import zmq.asyncio

from configs.schema import PdserveConfig
from server.launch.exit_watch import ExitWatch
from server.launch.launch_auth import launch_auth
from server.launch.node_cgroups import NodeGroupError, NodeGroups, node_threads
from server.launch.ports import PortUnavailable, reserve_worker_ports
from server.launch.roles import WORKER_ROLES, bind_addr, worker_argv, worker_specs
from server.launch.supervisor import RestartPolicy, WorkerSupervisor
from server.launch.worker_cores import core_lending, with_planner_cores
from server.launch.worker_procs import ExternalWorkers, WorkerProcesses
from server.router.registry import WorkerSpec
from server.worker.placement import Placement, plan_placement
from transfer.control_auth import ControlAuth, ControlAuthError
from transfer.wire.enums import Role

__all__ = ["Launcher", "LaunchError", "worker_specs", "worker_argv", "launch_main", "router_main"]

log = logging.getLogger("pdserve.launch")
# Seconds the router keeps an idle HTTP/1.1 connection open. Client pools reuse an idle connection
# until their own expiry (httpx 5 s, aiohttp 15 s); a server closing at the same moment (uvicorn's
# default is 5 s) races them, and a request sent on a connection just closed fails with a transport
# error instead of a response (the overload chaos test saw a ReadError). Longer than the clients'
# expiry, the client is the side that closes.
KEEP_ALIVE_S = 75


class LaunchError(RuntimeError):
    """Startup failed; the message says what to fix."""


def with_cluster_id(cfg: PdserveConfig, own_workers: bool) -> PdserveConfig:
    """``cfg`` with the launch's cluster id: the configured one, else a random one when this launch
    runs the router and all its workers (``own_workers``), else unchecked (empty)."""
    if cfg.cluster.cluster_id is not None:
        return cfg
    cid = uuid.uuid4().hex[:12] if own_workers else ""
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"cluster_id": cid})})


def reserve_ports(specs: list[WorkerSpec], cfg: PdserveConfig) -> dict:
    """The local workers' listening sockets (``server.launch.ports``); ``LaunchError`` if one is busy."""
    try:
        return reserve_worker_ports(specs, cfg)
    except PortUnavailable as e:
        raise LaunchError(str(e)) from None


def close_ports(ports: dict) -> None:
    for s in ports.values():
        s.close()


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); ``LaunchError`` if it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is
    # IPPROTO_TCP, and accepted sockets inherit the listener's. With proto 0 every response on a
    # kept-alive connection waited ~40 ms for the client's delayed ACK (headers and body are two writes).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LaunchError(f"cannot bind HTTP server to {host}:{port}: {e.strerror}; choose another --port") from None
    sock.set_inheritable(True)
    return sock


def public_url(host: str, port: int) -> str:
    """The URL clients on this machine use (wildcard binds are reached through loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the launcher owns SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Launcher:
    """One ``pdserve launch`` run; :meth:`run` returns the process exit code."""

    def __init__(
        self,
        cfg: PdserveConfig,
        argv: Callable[[WorkerSpec, PdserveConfig], list[str]] = worker_argv,
        out: TextIO | None = None,
        startup_timeout_s: float = 600.0,
        install_signals: bool = True,
        specs: list[WorkerSpec] | None = None,
        roles: frozenset[Role] | None = None,
        remote: list[WorkerSpec] | None = None,
    ) -> None:
        """``specs``: route to these already running workers instead of starting ``cfg``'s own.
        ``roles``: start only these roles here (see ``server.launch.roles``; without ``router`` no HTTP
        server runs and the launcher only keeps its workers running); ``remote``: workers on other
        hosts that the router routes to besides its own."""
        self.own_workers = (
            specs is None and not remote and (roles is None or set(WORKER_ROLES[cfg.cluster.mode]) <= roles)
        )
        self.cfg = with_cluster_id(cfg, own_workers=self.own_workers)
        self.auth = ControlAuth.insecure()  # set by run() (launch_auth)
        self.child_env: dict[str, str] = {}
        self.external_specs = specs
        self.roles = roles
        self.remote = list(remote or [])
        self.argv = argv
        self.out = out or sys.stdout
        self.startup_timeout_s = startup_timeout_s
        self.install_signals = install_signals
        self.stop_event: asyncio.Event | None = None
        self.server: _Server | None = None

    def _start_workers(self, local: list[WorkerSpec], pin_router: bool, ports: dict) -> WorkerProcesses:
        """Start this host's workers on their held ``ports`` (listening sockets by worker id), each
        on its own cores (``cluster.worker_cpus``; the plan is logged) or node (``cluster.node_cpus``:
        a CPU-quota group each, no lending) and, with ``pin_router``, this process on the cores left
        over. Resolves ``server.planner_cores`` ``auto``: ``shared`` when the workers lend cores."""
        node = self.cfg.cluster.node_cpus
        try:
            plan = plan_placement([s.worker_id for s in local], self.cfg.cluster.worker_cpus)
        except ValueError as e:
            raise LaunchError(str(e)) from None
        plan = dataclasses.replace(plan, threads=node_threads(node)) if node else plan
        fds = {wid: s.fileno() for wid, s in ports.items()}
        log.info("%s%s", plan.describe(), f"; each worker a node of {node:g} cores (CPU quota)" if node else "")
        if pin_router and plan.router:
            os.sched_setaffinity(0, plan.router)
        lending = None if node else self._core_lending(local, plan)
        ledger_fd = lending[0] if lending else None
        self.cfg = with_planner_cores(self.cfg, shared=lending is not None)

        def argv(spec: WorkerSpec) -> list[str]:
            cpus = plan.workers.get(spec.worker_id)
            pin = ["--cpus", "+".join(map(str, cpus))] if cpus else []
            threads = ["--threads", str(plan.threads)] if plan.threads and not cpus else []
            return self.argv(spec, self.cfg) + [
                "--listen-fd",
                str(fds[spec.worker_id]),
                *pin,
                *threads,
                *(lending[1][spec.worker_id] if lending else []),
            ]

        try:
            return WorkerProcesses(
                local,
                argv,
                fds,
                shared_fds=() if ledger_fd is None else (ledger_fd,),
                env=self.child_env,
                groups=NodeGroups(node) if node else None,
            )
        except NodeGroupError as e:
            raise LaunchError(str(e)) from None

    def _core_lending(self, local: list[WorkerSpec], plan: Placement) -> tuple[int, dict[str, list[str]]] | None:
        """``server.launch.worker_cores.core_lending`` for this launch's ``cluster.core_lending``."""
        return core_lending(self.cfg.cluster.core_lending, local, plan)

    def request_stop(self, force: bool = False) -> None:
        """Begin a clean shutdown; ``force`` makes uvicorn drop open connections at once."""
        if self.server is not None:
            self.server.force_exit = self.server.force_exit or force
            self.server.should_exit = True
        if self.stop_event is not None:
            self.stop_event.set()

    def _on_signal(self) -> None:
        """SIGINT/SIGTERM: stop; a second signal forces it."""
        self.request_stop(force=self.stop_event is not None and self.stop_event.is_set())

    async def run(self) -> int:
        """Start everything, serve until stopped. 0 after a requested stop, 1 if startup failed."""
        self.stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        if self.install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal)
        try:
            return await self._run()
        except LaunchError as e:
            print(f"pdserve launch: error: {e}", file=sys.stderr, flush=True)
            return 1
        finally:
            if self.install_signals:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    async def _run(self) -> int:
        try:
            self.auth, self.child_env = launch_auth(self.cfg, self.own_workers)
        except ControlAuthError as e:
            raise LaunchError(str(e)) from None
        local = [] if self.external_specs is not None else worker_specs(self.cfg, self.roles)
        if self.roles is not None and Role.ROUTER not in self.roles:
            return await self._run_workers_only(local)
        specs = self.external_specs if self.external_specs is not None else local + self.remote
        if not specs and not self.cfg.cluster.discovery:
            raise LaunchError(
                "no worker to route to: --roles starts none here and neither --worker nor --discovery was given"
            )
        sock = bind_http_socket(self.cfg.server.host, self.cfg.server.port)
        try:
            ports = reserve_ports(local, self.cfg)
        except LaunchError:
            sock.close()
            raise
        procs = self._start_workers(local, pin_router=True, ports=ports) if local else ExternalWorkers()
        zctx = zmq.asyncio.Context()
        try:
            return await self._serve(sock, specs, procs, zctx)
        finally:
            # its router is gone (without discovery no other one found them): drain, no quiet period
            await asyncio.to_thread(procs.stop, sig=signal.SIGTERM if self.cfg.cluster.discovery else signal.SIGUSR1)
            sock.close()
            close_ports(ports)
            zctx.destroy(linger=0)

    async def _serve(self, sock: socket.socket, specs: list[WorkerSpec], procs: WorkerProcesses, zctx) -> int:
        """Serve the router's HTTP app on ``sock`` until stopped (0), its server stopped at the end."""
        from server.router.app import build_context, create_app, zmq_client_factory

        srv = self.cfg.server
        name, tokenizer = await self._tokenizer()
        ctx = build_context(
            self.cfg, tokenizer, name, specs, zmq_client_factory(zctx, self.auth), auth=self.auth, zctx=zctx
        )
        config = uvicorn.Config(
            create_app(ctx),
            log_level=srv.log_level.lower(),
            lifespan="on",
            timeout_graceful_shutdown=5,
            access_log=srv.log_level == "DEBUG",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self.server = _Server(config)
        serve_task = asyncio.create_task(self.server.serve(sockets=[sock]))
        try:
            url = public_url(srv.host, sock.getsockname()[1])
            if not await self._wait_ready(url, serve_task, procs, ctx.registry):
                return 0
            print(f"pdserve: serving {name} at {url} (OpenAI API: {url}/v1)", file=self.out, flush=True)
            await self._supervise(serve_task, procs, ctx.registry)
            return 0
        finally:
            await self._stop_server(serve_task)

    async def _tokenizer(self):
        """(served model name, tokenizer) of the configured model; ``LaunchError`` where it cannot load."""
        from engine.model_paths import resolve_model_path
        from engine.tokenizer import Tokenizer

        try:
            path = resolve_model_path(self.cfg.engine.model)
            tokenizer = await asyncio.to_thread(Tokenizer.from_path, path)
        except (OSError, ValueError) as e:
            raise LaunchError(f"cannot load the tokenizer: {e}") from None
        return self.cfg.server.served_model_name or path.stem, tokenizer

    async def _wait_ready(self, url: str, serve_task: asyncio.Task, procs: WorkerProcesses, registry) -> bool:
        """True once /health is 200; False if stopped first; ``LaunchError`` on failure."""
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while not self.stop_event.is_set():
                for spec, rc in procs.new_exits():
                    raise LaunchError(
                        f"worker {spec.worker_id} ({spec.role}) exited with code {rc} during "
                        f"startup; its error is in the log above"
                    )
                if serve_task.done():
                    raise LaunchError("the HTTP server stopped during startup; see the log above")
                if self.server.started and self._discovers_all(procs) and await self._health_ok(client, url, True):
                    return True  # workers come and go through discovery: serving does not wait for them
                if self.server.started and registry.health()[0] and await self._health_ok(client, url):
                    return True
                if time.monotonic() > deadline:
                    raise LaunchError(f"not ready after {self.startup_timeout_s:.0f}s: {registry.describe()}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop_event.wait(), 0.2)
        return False

    def _discovers_all(self, procs) -> bool:
        """Whether every worker of this router comes from discovery (none started or named here)."""
        return (
            bool(self.cfg.cluster.discovery)
            and isinstance(procs, ExternalWorkers)
            and not self.external_specs
            and not self.remote
        )

    @staticmethod
    async def _health_ok(client: httpx.AsyncClient, url: str, any_ok: bool = False) -> bool:
        """``/health`` answers 200 (``any_ok``: it answers at all)."""
        try:
            status = (await client.get(f"{url}/health")).status_code
        except httpx.HTTPError:
            return False
        return status in (200, 503) if any_ok else status == 200

    async def _supervise(self, serve_task: asyncio.Task, procs: WorkerProcesses, registry) -> None:
        """Until stopped: a worker whose process exited is marked dead (its requests fail with 503)
        and restarted by ``server.launch.supervisor`` (back-off, then giving up with the reason in
        ``/health``); it serves again once it answers heartbeats."""
        supervisor = WorkerSupervisor(procs, RestartPolicy.from_config(self.cfg.cluster), registry)
        exits = ExitWatch(asyncio.get_running_loop())  # an exit wakes the loop at once, not at the next tick
        try:
            while not self.stop_event.is_set() and not serve_task.done():
                supervisor.tick()
                exits.track(procs.live_pids())
                await exits.wait(self.stop_event, 0.5)
        finally:
            exits.close()

    async def _run_workers_only(self, local: list[WorkerSpec]) -> int:
        """``--roles`` without ``router``: start the workers, print one line once every one answers
        ``pdserve probe``-style readiness, keep them running (restarts as in :meth:`_supervise`)."""
        from server.launch.probe import ProbeError, probe_worker
        from server.launch.probe import local as local_addr

        if not local:
            raise LaunchError("--roles names no worker role of this cluster mode; nothing to start")
        ports = reserve_ports(local, self.cfg)
        procs = self._start_workers(local, pin_router=False, ports=ports)
        try:
            deadline = time.monotonic() + self.startup_timeout_s
            pending = list(local)
            while pending and not self.stop_event.is_set():
                for spec, rc in procs.new_exits():
                    raise LaunchError(f"worker {spec.worker_id} ({spec.role}) exited with code {rc} during startup")
                try:
                    await asyncio.to_thread(probe_worker, local_addr(bind_addr(pending[0], self.cfg)), 1.0, self.auth)
                    pending.pop(0)
                except ProbeError:
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"worker {pending[0].worker_id} not ready after {self.startup_timeout_s:.0f}s"
                        ) from None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop_event.wait(), 0.5)
            if pending:
                return 0
            names = ", ".join(f"{s.worker_id}={s.addr}" for s in local)
            print(f"pdserve: workers ready: {names}", file=self.out, flush=True)
            await self._supervise_workers(procs)
            return 0
        finally:
            await asyncio.to_thread(procs.stop)
            close_ports(ports)

    async def _supervise_workers(self, procs: WorkerProcesses) -> None:
        """Restart exited workers as :meth:`_supervise` does; with no ``/health`` here to report it,
        giving up on one ends the launch (exit code 1, the reason on stderr)."""
        from server.launch.probe import ProbeError, probe_worker
        from server.launch.probe import local as local_addr

        def ready(spec: WorkerSpec) -> bool:
            try:
                probe_worker(local_addr(bind_addr(spec, self.cfg)), 0.5, self.auth)
                return True
            except ProbeError:
                return False

        supervisor = WorkerSupervisor(procs, RestartPolicy.from_config(self.cfg.cluster), is_ready=ready)
        while not self.stop_event.is_set():
            for wid in supervisor.tick():
                raise LaunchError(f"worker {wid}: {supervisor.given_up[wid]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), 0.5)

    async def _stop_server(self, serve_task: asyncio.Task | None) -> None:
        if serve_task is None:
            return
        self.request_stop()
        try:
            await asyncio.wait_for(serve_task, 15)
        except (TimeoutError, SystemExit, Exception) as e:  # noqa: BLE001 - shutting down regardless
            log.warning("HTTP server shutdown: %r", e)


def router_main(cfg: PdserveConfig, specs: list[WorkerSpec]) -> int:
    """Run the router alone in front of ``specs`` (workers started elsewhere)."""
    logging.getLogger().setLevel(cfg.server.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(Launcher(cfg, specs=specs).run())


def launch_main(
    cfg: PdserveConfig, roles: frozenset[Role] | None = None, remote: list[WorkerSpec] | None = None
) -> int:
    """Run ``pdserve launch`` for ``cfg`` (only ``roles`` here, plus ``remote`` workers for the
    router) in a new event loop; returns the exit code."""
    logging.getLogger().setLevel(cfg.server.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the readiness probe's requests
    return asyncio.run(Launcher(cfg, roles=roles, remote=remote).run())
