"""``pdserve`` command line: ``generate`` (offline batch), ``launch`` (serve over HTTP), ``worker``,
``router``, ``probe``, ``keygen`` (a cluster key file), ``models`` (what the loader serves), ``role``
(switch a running PD worker's role through its router) and ``bench``.

Parsing lives in ``server.launch.args``; each command here is one function, picked by name.
``pdserve bench ...`` runs ``python -m bench ...`` in a child process: the benchmarks sit above
everything and nothing in the serving packages imports them.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import sys

from configs.cli_flags import collect
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from server.launch.args import load_config, parse_args
from server.worker.process_exit import exit_now
from transfer.wire.enums import Role


def _cmd_generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from configs.schema import env_overrides
    from engine.llm import LLM
    from transfer.wire.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_new_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            ignore_eos=args.ignore_eos,
        )
        env = env_overrides()  # PDSERVE_<FIELD> as for every subcommand; flags win
        engine = EngineConfig(**{**env.get("engine", {}), **collect(args, EngineConfig)})
        sched = SchedulerConfig(**{**env.get("scheduler", {}), **collect(args, SchedulerConfig)})
    except ValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        llm = LLM(engine, sched)
    except (ValueError, FileNotFoundError) as e:  # unsupported model / flag combination: says what to change
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in llm.generate(args.prompt, params, chat=args.chat):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt_token_ids": r.prompt_token_ids,
                        "token_ids": r.token_ids,
                        "text": r.text,
                        "finish_reason": r.finish_reason,
                        "stop_token_id": r.stop_token_id,
                        **({"error": r.error} if r.error else {}),
                    }
                ),
                flush=True,
            )
        else:
            print(r.text if not r.error else f"[error] {r.error}", flush=True)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from server.launch.launcher import launch_main
    from server.launch.roles import parse_roles, parse_worker_spec

    cfg = load_config(args, "launch")
    if cfg is None:
        return 2
    try:
        roles = parse_roles(args.roles, cfg.cluster.mode)
        remote = [parse_worker_spec(w) for w in args.worker]
    except ValueError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return 2
    if remote and Role.ROUTER not in roles:
        print("pdserve launch: --worker is for the router; add router to --roles", file=sys.stderr)
        return 2
    if roles - {Role.ROUTER} and not _model_fits(cfg):
        return 2
    return launch_main(cfg, roles if args.roles else None, remote)


def _model_fits(cfg) -> bool:
    """Start-up check of the model against the engine flags before any worker starts (reads no
    weights); False after printing what to change."""
    from engine.loader import check_startup
    from engine.model_paths import resolve_model_path

    try:
        check_startup(resolve_model_path(cfg.engine.model), cfg.engine)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return False
    return True


def worker_id(role: str, given: str | None) -> str:
    """``given``, or ``ROLE-HOSTNAME`` when ``--worker-id`` was left out (a container's or pod's
    hostname is its own, so scaled replicas get distinct ids with one command line)."""
    return given or f"{role}-{socket.gethostname()}"


def _cmd_worker(args: argparse.Namespace) -> int:
    from server.worker.main import main as worker_main

    cfg = load_config(args, "worker")
    if cfg is None:
        return 2
    return worker_main(
        [
            "--role",
            args.role,
            "--worker-id",
            worker_id(args.role, args.worker_id),
            "--control-addr",
            args.control_addr,
            "--config-json",
            cfg.model_dump_json(),
        ]
    )


def _cmd_router(args: argparse.Namespace) -> int:
    from server.launch.launcher import router_main
    from server.launch.roles import parse_worker_spec

    cfg = load_config(args, "router")
    if cfg is None:
        return 2
    try:
        specs = [parse_worker_spec(w) for w in args.worker]
    except ValueError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    if not specs and not cfg.cluster.discovery:
        print(
            "pdserve router: name the workers (--worker ROLE=ID=ADDR, repeatable) or where to find them "
            "(--discovery etcd://HOST:PORT or dns://NAME:PORT)",
            file=sys.stderr,
        )
        return 2
    return router_main(cfg, specs)


def _cmd_probe(args: argparse.Namespace) -> int:
    from server.launch.probe import main as probe_main

    return probe_main(args)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from transfer.cluster_key import ClusterKey, key_file_text, write_key_file

    key = ClusterKey.generate()
    if args.file == "-":
        sys.stdout.write(key_file_text(key))
        return 0
    try:
        write_key_file(args.file, key, overwrite=args.force)
    except FileExistsError:
        print(
            f"pdserve keygen: {args.file} exists; pass --force to replace it (every process holding the old "
            f"key then needs the new one)",
            file=sys.stderr,
        )
        return 1
    except OSError as e:
        print(f"pdserve keygen: cannot write {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"pdserve keygen: wrote cluster key {args.file} (mode 0600, fingerprint {key.fingerprint})")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from engine.supported_models import models_text, refused, supported_models

    if args.json:
        models = [asdict(m) for m in supported_models()]
        print(json.dumps({"models": models, "refused": [{"what": w, "how": h} for w, h in refused()]}, indent=1))
    else:
        sys.stdout.write(models_text())
    return 0


def _cmd_role(args: argparse.Namespace) -> int:
    from server.launch.role_cmd import main as role_main

    return role_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    return subprocess.call([sys.executable, "-m", "bench", *args.bench_argv])


COMMANDS = {
    "generate": _cmd_generate,
    "launch": _cmd_launch,
    "worker": _cmd_worker,
    "router": _cmd_router,
    "probe": _cmd_probe,
    "keygen": _cmd_keygen,
    "models": _cmd_models,
    "role": _cmd_role,
    "bench": _cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    """Run one ``pdserve`` command (``argv``: the process's own by default); returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return COMMANDS[args.command](args)


def entry() -> None:
    """Entry point of the ``pdserve`` script and of ``python -m server.launch.cli``: ``main``, then
    the process ends with its status at once (``exit_now``: no interpreter teardown)."""
    exit_now(main())


if __name__ == "__main__":
    entry()
