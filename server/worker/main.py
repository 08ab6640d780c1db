"""Worker process entry point: ``python -m server.worker.main --role colocated|prefill|decode ...``.

The launcher passes the whole validated config as JSON (``--config-json``) so every process sees
the same settings; the worker binds its control socket at ``--control-addr``.

The control plane is authenticated (``transfer.control_auth``) with the cluster key from
``cluster.cluster_key`` (``--cluster-key FILE``) or ``PDSERVE_CLUSTER_SECRET_KEY`` (how ``pdserve
launch`` hands over its ephemeral key). A worker with neither refuses to start (exit code 2)
unless ``--insecure-control-plane`` is set, and then warns on every start.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import socket
import sys

import torch

from configs.schema import PdserveConfig
from engine.probe_memo import ProbeMemo, QuietWindow
from server.worker.loop import WorkerLoop
from server.worker.placement import apply_cpus, parse_cpu_list
from server.worker.process_exit import exit_now
from transfer.control_auth import ControlAuthError, resolve_auth
from transfer.wire.enums import Role

log = logging.getLogger(__name__)


def load_runner(cfg: PdserveConfig):
    """(runner, model path) with the configured model loaded and the KV pool allocated."""
    from engine.loader import load_for_engine
    from engine.model_paths import resolve_model_path
    from engine.model_runner import ModelRunner

    torch.manual_seed(cfg.engine.seed)
    path = resolve_model_path(cfg.engine.model)
    model_config, weights = load_for_engine(path, cfg.engine)
    return ModelRunner(cfg.engine, model_config, weights), path


@contextlib.contextmanager
def measuring_turn(ledger_fd: int):
    """This worker's turn among the launch's workers (an exclusive ``flock`` on the ledger they
    share) to time its matmuls in ``core_lending`` with no other worker measuring beside it."""
    # a lock belongs to an open file description, and the inherited fd is one description shared by
    # every worker: each opens its own
    own = os.open(f"/proc/self/fd/{ledger_fd}", os.O_RDONLY)
    try:
        fcntl.flock(own, fcntl.LOCK_EX)
        yield
    finally:
        os.close(own)


# Core lending: rows of the step a role's borrowing is judged by (a decode batch, a prefill chunk),
# and the gain that makes borrowing worth a thread switch per step.
# A prefill chunk's probe has 128 rows: past the small-batch kernels' 64-row limit (cpu_linear.small_rows), so
# it times the kernels a prefill chunk runs, at half the cost of a 256-row one.
LENDING_PROBE_ROWS = {"decode": 8, "prefill": 128, "colocated": 128}
LENDING_MIN_GAIN = 1.1
LENDING_PROBE_ROUNDS = 4  # at most; fewer once LENDING_PROBE_BUDGET_S is spent (2 at least) or the verdict is clear
LENDING_PROBE_MIN_ROUNDS = 2
LENDING_PROBE_REPEATS = 2  # timed passes per probe (after one warm-up pass)
LENDING_PROBE_BUDGET_S = 2.0  # a prefill probe on an AVX2 core in float32 is ~0.5 s a pass: 2 rounds, not 4
# A round whose gain is this factor past LENDING_MIN_GAIN (either way) decides at once: one noisy pass cannot
# move a 2-thread gain of 1.4x under 1.1x, and the start-up of every launch pays for each further round.
LENDING_CLEAR_FACTOR = 1.25
LENDING_LOAD_WAIT_S = 300.0  # the longest a worker waits for the others' loads before it measures
LENDING_QUIET_WAIT_S = 3.0  # ... and then for a busy peer to go idle (a restarted worker among serving ones: not long)


def core_lending(args, runner, verdict: str = "measure", memo: ProbeMemo | None = None):
    """This worker's ``CoreLending`` when the launcher passed a core ledger (its kernels warmed up
    at every thread count a step may use), else None. ``verdict`` (``cluster.core_lending_verdict``)
    "borrow" or "lend" pins the choice without measuring. Else a worker the launcher lets borrow does so only
    if its steps' matmuls measure ``LENDING_MIN_GAIN`` x faster on every core than on its own share
    (``ModelRunner.matmul_seconds`` at its role's ``LENDING_PROBE_ROWS``); else it only lends. The
    workers load in parallel; each measures once every worker of the launch has loaded (ledger
    slots: call this once the worker's start-up work is done, ``main``), one at a time
    (``measuring_turn``), and with no other worker's slot busy, so no measurement runs beside
    another's load or start-up: a probe beside a peer still building its scheduler and grammar
    tokenizer times the shared cores slower than they are, and a worker that gains from borrowing
    then only lends, decoding far slower than it could at low load. With a ``memo``
    (``engine.probe_memo``), a verdict this machine measured for the same matmuls within a day is
    reused: no probe and no wait for busy peers (a worker restarted beside serving ones)."""
    if args.core_ledger_fd is None:
        return None
    from server.worker.core_lending import CoreLedger, CoreLending

    ledger = CoreLedger.open(args.core_ledger_fd)
    ledger.set_loaded(args.core_slot)
    own = torch.get_num_threads()
    total = max(own, args.lend_threads or own)
    if total > own and runner.device.type == "cpu":
        if not ledger.wait_all_loaded(LENDING_LOAD_WAIT_S):
            log.warning("core lending: not every worker loaded within %.0f s; measuring anyway", LENDING_LOAD_WAIT_S)
        with measuring_turn(args.core_ledger_fd):  # the warm-up too: it builds kernels, a load of its own
            if verdict == "measure":
                total = _lending_total(args, ledger, runner, own, total, memo)
            else:
                total = total if verdict == "borrow" else own
                log.info(
                    "core lending: step matmuls not measured (--core-lending-verdict %s): %s",
                    verdict,
                    "borrows" if verdict == "borrow" else "only lends",
                )
            runner.warm_up_threads((own, total))
    cores = CoreLending(ledger, args.core_slot, own, total)
    log.info(
        "core lending: slot %d, %d torch threads, %d while the launch's other workers are idle",
        cores.slot,
        cores.own,
        cores.total,
    )
    return cores


def _lending_total(args, ledger, runner, own: int, total: int, memo: ProbeMemo | None) -> int:
    """``total`` if this worker's step matmuls gain ``LENDING_MIN_GAIN`` x on it, else ``own``: the
    timings ``memo`` holds for them, else measured once no peer is busy (and then remembered)."""
    rows = LENDING_PROBE_ROWS.get(args.role, 8)
    key = None
    if memo is not None:
        key = {"probe": "core_lending", "rows": rows, "threads": [own, total], "model": runner.matmul_fingerprint()}
        found = memo.get(key)
        if found is not None:
            how = f"measured {found.age_s() / 60:.0f} min ago, remembered in {memo.path}"
            return _verdict(rows, own, total, found.value["alone_s"], found.value["shared_s"], how)
    if not ledger.wait_others_idle(args.core_slot, LENDING_QUIET_WAIT_S):
        log.warning("core lending: another worker stayed busy for %.0f s; measuring anyway", LENDING_QUIET_WAIT_S)
    window = QuietWindow()
    alone, shared = _measured(runner, rows, own, total)
    how = "measured"
    if memo is not None and window.quiet(spare_cores=max(0, (os.cpu_count() or total) - total)):
        memo.put(key, {"alone_s": alone, "shared_s": shared})
        how += f", remembered in {memo.path}"
    elif memo is not None:
        how += f" beside {window.others_cpu_s() or 0.0:.2f} CPU s of other processes: not remembered"
    return _verdict(rows, own, total, alone, shared, how)


def _verdict(rows: int, own: int, total: int, alone: float, shared: float, how: str) -> int:
    """``total`` if ``alone / shared`` (the matmuls' seconds on ``own`` and on ``total`` threads)
    reaches ``LENDING_MIN_GAIN``, else ``own``; logged with ``how`` the timings were had."""
    gain = alone / shared if shared > 0 else 1.0
    log.info(
        "core lending: %d-row step matmuls %.2f ms on %d threads, %.2f ms on %d: %.2fx, %s (%s)",
        rows,
        alone * 1e3,
        own,
        shared * 1e3,
        total,
        gain,
        "borrows" if gain >= LENDING_MIN_GAIN else f"only lends (under {LENDING_MIN_GAIN}x)",
        how,
    )
    return total if gain >= LENDING_MIN_GAIN else own


def _measured(runner, rows: int, own: int, total: int) -> tuple[float, float]:
    """The best seconds of this worker's ``rows``-row step matmuls on ``own`` and on ``total`` threads,
    over alternating rounds until the gain is clear or the time budget is spent."""
    alone = shared = float("inf")
    spent = 0.0  # the probes' time (passes x best pass): deterministic, and what start-up pays
    # alternating rounds: a slow moment (a fresh thread, a page fault storm after the load) hits both
    for done in range(1, LENDING_PROBE_ROUNDS + 1):
        a = runner.matmul_seconds(own, rows, LENDING_PROBE_REPEATS)
        b = runner.matmul_seconds(total, rows, LENDING_PROBE_REPEATS)
        alone, shared = min(alone, a), min(shared, b)
        spent += (a + b) * (LENDING_PROBE_REPEATS + 1)
        gain = alone / shared if shared > 0 else 1.0
        if _clear(gain) or (done >= LENDING_PROBE_MIN_ROUNDS and spent >= LENDING_PROBE_BUDGET_S):
            break
    return alone, shared


def _clear(gain: float) -> bool:
    """Whether one round's ``gain`` settles the verdict (``LENDING_CLEAR_FACTOR`` past the bar, either way)."""
    return gain >= LENDING_MIN_GAIN * LENDING_CLEAR_FACTOR or gain <= LENDING_MIN_GAIN / LENDING_CLEAR_FACTOR


def build_colocated(cfg: PdserveConfig, runner, worker_id: str, model_name: str):
    from engine.scheduler.colocated import ColocatedScheduler

    return ColocatedScheduler(runner, cfg.scheduler, tuple(runner.model_config.eos_token_ids))


def build_prefill(cfg: PdserveConfig, runner, worker_id: str, model_name: str):
    from prefill_worker.scheduler import create_prefill_scheduler
    from transfer.factory import create_transport

    transport = create_transport(cfg.cluster.transfer_backend, worker_id, cfg.cluster)
    return create_prefill_scheduler(runner, cfg, transport, worker_id, model_name)


def build_decode(cfg: PdserveConfig, runner, worker_id: str, model_name: str):
    from decode_worker.scheduler import create_decode_scheduler
    from transfer.factory import create_transport, migration_options, receive_options

    backend = cfg.cluster.transfer_backend
    transport = create_transport(backend, worker_id, cfg.cluster, **receive_options(backend, cfg.cluster))
    migration = None  # a second transport, over the host pool, to write retracted KV to peers
    if cfg.cluster.migrate_after is not None and cfg.cluster.host_kv_pool_gb > 0:
        migration = create_transport(
            backend, f"{worker_id}-migrate", cfg.cluster, **migration_options(backend, cfg.cluster)
        )
    return create_decode_scheduler(runner, cfg, transport, worker_id, model_name, migration_transport=migration)


BUILDERS = {Role.COLOCATED: build_colocated, Role.PREFILL: build_prefill, Role.DECODE: build_decode}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-worker")
    p.add_argument("--role", choices=sorted(map(str, BUILDERS)), required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--control-addr", required=True, help="ZMQ address to bind, e.g. tcp://127.0.0.1:29500")
    p.add_argument("--config-json", required=True)
    p.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve --control-addr on this inherited, already listening socket (the launcher's)",
    )
    p.add_argument(
        "--advertise-addr",
        default=None,
        help="the control address routers reach this worker at, registered in discovery (default: "
        "--control-addr, with a wildcard host replaced by advertise_host or the hostname)",
    )
    _add_core_flags(p)
    return p


def _add_core_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the cores a worker runs on: pinning, its thread share, core lending."""
    p.add_argument(
        "--cpus",
        type=parse_cpu_list,
        default=(),
        help="pin this worker to these cores, torch with one thread each (e.g. 0-1 or 0+2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of this (unpinned) worker; the launcher gives co-located workers their share",
    )
    p.add_argument(
        "--core-ledger-fd",
        type=int,
        default=None,
        help="inherited memfd of the launch's core ledger (server.worker.core_lending)",
    )
    p.add_argument("--core-slot", type=int, default=0, help="this worker's slot in the core ledger")
    p.add_argument(
        "--lend-threads",
        type=int,
        default=None,
        help="torch threads of a step while every other worker of the launch is idle (default: "
        "this worker's own; it then only lends)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_cpus(args.cpus, args.threads)
    cfg = PdserveConfig.model_validate_json(args.config_json)
    logging.basicConfig(
        level=cfg.server.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{args.worker_id}] %(name)s: %(message)s",
    )
    try:
        auth = resolve_auth(cfg.cluster.cluster_key, cfg.cluster.insecure_control_plane)
    except ControlAuthError as e:
        print(f"pdserve worker {args.worker_id}: refusing to start: {e}", file=sys.stderr, flush=True)
        return 2
    if not auth.secure:
        log.warning(
            "control plane NOT authenticated (--insecure-control-plane): anyone who can reach %s can "
            "submit, abort and shut down requests of this worker; use --cluster-key FILE",
            args.control_addr,
        )
    return serve(cfg, args, auth)


def serve(cfg: PdserveConfig, args, auth) -> int:
    """Load the model, build the role's scheduler and run the worker loop until it exits; its exit
    code: 0 after a drain (a launcher leaves it down), EXIT_SHUTDOWN after a Shutdown."""
    runner, path = load_runner(cfg)
    grammar = runner.grammar.prepare_in_background()  # not in the loop at the first structured request
    name = cfg.server.served_model_name or path.stem
    scheduler = BUILDERS[args.role](cfg, runner, args.worker_id, name)
    if grammar is not None:
        # start-up work done before the worker serves (a build beside the loop held the GIL for
        # seconds of its first requests) and before the launch's lending probes time anything
        grammar.join()
    loop = WorkerLoop(
        args.control_addr,
        args.worker_id,
        name,
        cfg.cluster.cluster_id or "",
        args.listen_fd,
        heartbeat_s=cfg.server.health_interval_s,
        progress_timeout_s=cfg.cluster.progress_timeout_s,
        step_delay_s=cfg.scheduler.test_step_delay_s,
        cores=core_lending(args, runner, cfg.cluster.core_lending_verdict, ProbeMemo.from_env()),
        drain_timeout_s=cfg.cluster.drain_timeout_s,
        auth=auth,
    )
    registration = register(cfg, args, name)
    if registration is not None:
        loop.on_drain.append(registration.leave)
    else:  # a role switch announces the new role through the router's membership, not etcd's records (yet)
        loop.switcher = role_switcher(cfg, runner, args.worker_id, name)
    try:
        loop.run(scheduler)
    finally:
        if registration is not None:
            registration.close()
    return loop.exit_code


def role_switcher(cfg: PdserveConfig, runner, worker_id: str, model_name: str):
    """The worker's ``RoleSwitcher``: a new role's scheduler over the same ``runner`` (weights kept),
    a switch given ``drain_timeout_s`` to empty the worker."""
    from server.worker.role_switch import RoleSwitcher

    return RoleSwitcher(lambda role: BUILDERS[role](cfg, runner, worker_id, model_name), cfg.cluster.drain_timeout_s)


def advertise_addr(cfg: PdserveConfig, control_addr: str) -> str:
    """``control_addr`` as other hosts reach it: a wildcard host becomes ``advertise_host`` or the
    hostname."""
    host, _, port = control_addr.removeprefix("tcp://").rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", "*", ""):
        return control_addr
    host = cfg.cluster.advertise_host or socket.gethostname()
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def register(cfg: PdserveConfig, args, model_name: str):
    """This worker's ``EtcdRegistration`` (started) when ``cluster.discovery`` names etcd, else None."""
    from server.discovery.target import EtcdTarget, WorkerRecord, parse_targets
    from server.worker.registration import EtcdRegistration

    if not cfg.cluster.discovery:
        return None
    targets = [t for t in parse_targets(cfg.cluster.discovery) if isinstance(t, EtcdTarget)]
    if not targets:
        return None
    record = WorkerRecord(
        worker_id=args.worker_id,
        role=args.role,
        model=model_name,
        cluster_id=cfg.cluster.cluster_id or "",
        bind_addr=args.control_addr,
        addr=args.advertise_addr or advertise_addr(cfg, args.control_addr),
    )
    reg = EtcdRegistration(targets[0], record, cfg.cluster.discovery_lease_s)
    reg.start()
    return reg


if __name__ == "__main__":
    exit_now(main())
