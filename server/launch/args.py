"""The ``pdserve`` argument parser and the config it yields; no command runs here.

``build_parser()`` knows every subcommand's flags; ``load_config`` merges preset < env < flags into
one ``PdserveConfig``. The commands themselves live in ``server.launch.cli`` (which dispatches on
``args.command``), so the probe can parse a ``pdserve`` command line without importing them.
"""

from __future__ import annotations

import argparse
import sys

from configs.cli_flags import add_flags, collect
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from transfer.wire.enums import ALL_WORKER_ROLES


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate offline for one or more prompts (one batch)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: tokens up to this probability mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = off)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate past the end-of-sequence token, up to --max-tokens"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    add_flags(p, EngineConfig)
    add_flags(p, SchedulerConfig)


def _config_flags(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` plus one flag per field of every config section."""
    from configs.schema import ClusterConfig
    from configs.server import ServerConfig

    p.add_argument("--config", help="YAML or TOML preset with sections engine, scheduler, server, cluster")
    for model in (EngineConfig, SchedulerConfig, ClusterConfig):
        add_flags(p, model)
    add_flags(p, ServerConfig, skip=("log_level",))
    p.add_argument(
        "--log-level",
        dest="server_log_level",
        default=argparse.SUPPRESS,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the router and workers",
    )


def load_config(args: argparse.Namespace, command: str):
    """The merged config (preset < env < flags), or None after printing why it is invalid."""
    from pydantic import ValidationError

    from configs.schema import SECTIONS
    from configs.schema import load_config as merge

    cli: dict = {}
    for model in SECTIONS.values():
        cli.update(collect(args, model))
    cli.pop("log_level", None)  # the top-level --log-level is not the server's
    if hasattr(args, "server_log_level"):
        cli["log_level"] = args.server_log_level
    try:
        cfg = merge(args.config, cli)
        if cfg.cluster.discovery:
            from server.discovery.target import parse_targets

            parse_targets(cfg.cluster.discovery)  # DiscoveryError (a ValueError) names the accepted forms
        return cfg
    except (ValidationError, ValueError, OSError) as e:
        print(f"pdserve {command}: invalid configuration: {e}", file=sys.stderr)
        return None


def _launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="start the worker process(es) and the OpenAI-compatible HTTP router",
        description="Settings: --config preset < env PDSERVE_<FIELD> < these flags.",
    )
    p.add_argument(
        "--roles",
        help="start only these roles on this host, comma-separated: router, prefill, "
        "decode (pd) or router, colocated (default: all of the mode)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE=ID=ADDR",
        help="a worker on another host for this host's router, e.g. decode=decode-0=tcp://hostB:29501",
    )
    _config_flags(p)


def _worker_parser(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="run one worker process (multi-node deployments)",
        description="One colocated, prefill or decode worker; a router started with "
        "'pdserve router --worker ROLE=ID=ADDR' drives it.",
    )
    p.add_argument("--role", choices=[str(r) for r in ALL_WORKER_ROLES], required=True, help="what this worker does")
    p.add_argument(
        "--worker-id",
        help="this worker's name in logs, etcd and peers' messages (default: "
        "ROLE-HOSTNAME, unique per container or pod, so replicas need no flag)",
    )
    p.add_argument("--control-addr", required=True, help="ZMQ address to bind, e.g. tcp://0.0.0.0:29500")
    _config_flags(p)


def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="run the HTTP router alone, in front of workers started elsewhere")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ROLE=ID=ADDR",
        help="a worker to route to, e.g. decode=d0=tcp://decode0:29500 (repeatable; or --discovery)",
    )
    _config_flags(p)


def _probe_parser(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="exit 0 when the pdserve process here is ready (container health checks)",
        description="Target: http://HOST:PORT (router: GET /health) or tcp://HOST:PORT (a worker's "
        "control socket). Without one, derived from PID 1's pdserve command line.",
    )
    p.add_argument("target", nargs="?", help="http://HOST:PORT or tcp://HOST:PORT (default: from PID 1)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument(
        "--cluster-key",
        metavar="FILE",
        help="the cluster key to reach a worker with (default: PID 1's --cluster-key or PDSERVE_CLUSTER_KEY)",
    )


def _keygen_parser(sub) -> None:
    p = sub.add_parser(
        "keygen",
        help="write a new cluster key file (CURVE key pair) for --cluster-key",
        description="Writes a ZeroMQ CURVE key pair (Z85, ZeroMQ certificate format) with mode "
        "0600. Give every router, worker and probe of a deployment the same file.",
    )
    p.add_argument("file", help="where to write it ('-' for stdout, e.g. to pipe into a secret store)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")


def _models_parser(sub) -> None:
    p = sub.add_parser(
        "models",
        help="list the model architectures pdserve loads, their formats, RoPE types and what is refused",
        description="Prints what the loader accepts, computed from its own tables: each architecture "
        "with its checkpoint formats (HF folder, GGUF), RoPE types, sliding layers, biases and norms, "
        "the fields served with some values only and the tests that check it against transformers; "
        "then what is refused at load.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object: the architectures and the refusals")


def _role_parser(sub) -> None:
    from server.launch.role_cmd import add_parser

    add_parser(sub)


def _bench_parser(sub) -> None:
    """Every argument after ``bench`` is left to ``python -m bench`` (``parse_args`` below)."""
    sub.add_parser(
        "bench", help="benchmarks (engine, retract, transfer, serve): 'pdserve bench --help'", add_help=False
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``pdserve`` subcommand; ``args.command`` names the one given."""
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="log level of this pdserve process itself")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _generate_parser,
        _launch_parser,
        _worker_parser,
        _router_parser,
        _probe_parser,
        _keygen_parser,
        _models_parser,
        _role_parser,
        _bench_parser,
    ):
        add(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a ``pdserve`` command line; ``bench`` keeps its own arguments in ``args.bench_argv``."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.bench_argv = rest
    return args
