"""``pdserve`` command line: ``generate`` (offline batch), ``launch`` (serve over HTTP) and ``bench``."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from configs.cli_flags import add_flags, collect
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate offline for one or more prompts (one batch)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    add_flags(p, EngineConfig)
    add_flags(p, SchedulerConfig)
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, ignore_eos=args.ignore_eos)
        engine = EngineConfig(**collect(args, EngineConfig))
        sched = SchedulerConfig(**collect(args, SchedulerConfig))
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
            print(json.dumps({"prompt_token_ids": r.prompt_token_ids, "token_ids": r.token_ids,
                              "text": r.text, "finish_reason": r.finish_reason,
                              **({"error": r.error} if r.error else {})}), flush=True)
        else:
            print(r.text if not r.error else f"[error] {r.error}", flush=True)
    return 0


def _config_flags(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` plus one flag per field of every config section."""
    from configs.schema import ClusterConfig
    from configs.server import ServerConfig

    p.add_argument("--config", help="YAML or TOML preset with sections engine, scheduler, server, cluster")
    for model in (EngineConfig, SchedulerConfig, ClusterConfig):
        add_flags(p, model)
    add_flags(p, ServerConfig, skip=("log_level",))
    p.add_argument("--log-level", dest="server_log_level", default=argparse.SUPPRESS,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level of the router and workers")


def _load_config(args: argparse.Namespace, command: str):
    """The merged config (preset < env < flags), or None after printing why it is invalid."""
    from pydantic import ValidationError

    from configs.schema import SECTIONS, load_config

    cli: dict = {}
    for model in SECTIONS.values():
        cli.update(collect(args, model))
    cli.pop("log_level", None)  # the top-level --log-level is not the server's
    if hasattr(args, "server_log_level"):
        cli["log_level"] = args.server_log_level
    try:
        return load_config(args.config, cli)
    except (ValidationError, ValueError, OSError) as e:
        print(f"pdserve {command}: invalid configuration: {e}", file=sys.stderr)
        return None


def _launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="start the worker process(es) and the OpenAI-compatible HTTP router",
                       description="Settings: --config preset < env PDSERVE_<FIELD> < these flags.")
    p.add_argument("--roles", help="start only these roles on this host, comma-separated: router, prefill, "
                                   "decode (pd) or router, colocated (default: all of the mode)")
    p.add_argument("--worker", action="append", default=[], metavar="ROLE=ID=ADDR",
                   help="a worker on another host for this host's router, e.g. decode=decode-0=tcp://hostB:29501")
    _config_flags(p)
    p.set_defaults(func=_cmd_launch)


def _cmd_launch(args: argparse.Namespace) -> int:
    from server.launcher import launch_main
    from server.roles import parse_roles, parse_worker_spec

    cfg = _load_config(args, "launch")
    if cfg is None:
        return 2
    try:
        roles = parse_roles(args.roles, cfg.cluster.mode)
        remote = [parse_worker_spec(w) for w in args.worker]
    except ValueError as e:
        print(f"pdserve launch: {e}", file=sys.stderr)
        return 2
    if remote and "router" not in roles:
        print("pdserve launch: --worker is for the router; add router to --roles", file=sys.stderr)
        return 2
    if roles - {"router"} and not _model_fits(cfg):
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


def _worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run one worker process (multi-node deployments)",
                       description="One colocated, prefill or decode worker; a router started with "
                                   "'pdserve router --worker ROLE=ID=ADDR' drives it.")
    p.add_argument("--role", choices=["colocated", "prefill", "decode"], required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--control-addr", required=True, help="ZMQ address to bind, e.g. tcp://0.0.0.0:29500")
    _config_flags(p)
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from server.worker_main import main as worker_main

    cfg = _load_config(args, "worker")
    if cfg is None:
        return 2
    return worker_main(["--role", args.role, "--worker-id", args.worker_id, "--control-addr", args.control_addr,
                        "--config-json", cfg.model_dump_json()])


def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="run the HTTP router alone, in front of workers started elsewhere")
    p.add_argument("--worker", action="append", required=True, metavar="ROLE=ID=ADDR",
                   help="a worker to route to, e.g. decode=d0=tcp://decode0:29500 (repeatable)")
    _config_flags(p)
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    from server.launcher import router_main
    from server.roles import parse_worker_spec

    cfg = _load_config(args, "router")
    if cfg is None:
        return 2
    try:
        specs = [parse_worker_spec(w) for w in args.worker]
    except ValueError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    return router_main(cfg, specs)


def _probe_parser(sub) -> None:
    p = sub.add_parser("probe", help="exit 0 when the pdserve process here is ready (container health checks)",
                       description="Target: http://HOST:PORT (router: GET /health) or tcp://HOST:PORT (a worker's "
                                   "control socket). Without one, derived from PID 1's pdserve command line.")
    p.add_argument("target", nargs="?")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.set_defaults(func=_cmd_probe)


def _cmd_probe(args: argparse.Namespace) -> int:
    from server.probe import main as probe_main

    return probe_main(args)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    p.add_argument("what", choices=["engine", "retract", "transfer", "serve"],
                   help="engine: decode/prefill tokens/s vs HF transformers; retract: retract costs "
                        "(colocated and PD); transfer: KV transfer over NIXL and ucxx vs memcpy; serve: "
                        "OpenAI-compatible serving load generator (TTFT/TPOT/ITL, --compare colocated,pd, "
                        "--interference)")
    p.add_argument("--requests", type=int, default=16, help="retract: requests in the workload")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true", help="measure this engine only")
    p.add_argument("--backend", default="nixl,ucxx", help="transfer: data planes to measure (nixl, ucxx)")
    p.add_argument("--ucxx-error-handling", choices=["off", "on", "both"], default="off",
                   help="transfer: ucxx endpoint error handling to measure")
    p.add_argument("--dead-peer", action="store_true", help="transfer: also time a write to a killed peer")
    add_flags(p, EngineConfig)
    from bench.serve.options import add_serve_flags

    add_serve_flags(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    engine = EngineConfig(**collect(args, EngineConfig))
    if args.what == "serve":
        from bench.serve_bench import run_serve_bench

        return run_serve_bench(args, collect(args, EngineConfig))
    if args.what == "retract":
        from bench.retract_bench import run_retract_bench

        run_retract_bench(engine, args.requests, args.decode_tokens)
    elif args.what == "transfer":
        from bench.transfer_bench import main as transfer_main

        transfer_main(["--backend", args.backend, "--ucxx-error-handling", args.ucxx_error_handling]
                      + (["--dead-peer"] if args.dead_peer else []))
    else:
        from bench.engine_bench import run_engine_bench

        run_engine_bench(engine, args.batch_sizes, args.decode_tokens, args.prefill_tokens, not args.skip_hf)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _launch_parser(sub)
    _worker_parser(sub)
    _router_parser(sub)
    _probe_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
