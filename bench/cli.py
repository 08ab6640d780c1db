"""``pdserve bench engine|retract|transfer|serve|two-routers`` (also ``python -m bench``): the
benchmarks' command line. The benchmarks sit above every serving package; nothing there imports them.

``STANDALONE`` benchmarks have a parser of their own: ``pdserve bench NAME ARGS`` hands ARGS to that
module's ``main`` (``pdserve bench two-routers --help`` shows its flags)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from bench.results import command_line, new_results, write_if_asked
from bench.serve.options import add_serve_flags
from configs.cli_flags import add_flags, collect
from configs.engine import EngineConfig

# name -> module with ``main(argv) -> int``, run with the arguments after the name
STANDALONE = {"two-routers": "bench.two_routers", "compose-multiturn": "bench.compose_multiturn"}


RESULTS_HELP = (
    "write a results file (JSON: benchmark, commit, UTC date, machine, command, figures) into DIR "
    "(engine, engine --roofline, serve); e.g. benchmarks/results in a checkout, which "
    "benchmarks/render.py renders into the README and docs/benchmarks.md. Default: no file"
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``pdserve bench`` / ``python -m bench``."""
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="benchmarks",
        epilog="also: "
        + ", ".join(f"'pdserve bench {n} --help'" for n in STANDALONE)
        + " (benchmarks with flags of their own; two-routers: one router against two "
        "in front of the same workers, and the load spread across them)",
    )
    p.add_argument(
        "what",
        choices=["engine", "retract", "transfer", "serve"],
        help="engine: decode/prefill tokens/s vs HF transformers (--roofline: against the machine's "
        "read bandwidth and matmul peak); retract: retract costs "
        "(colocated and PD); transfer: KV transfer over NIXL and ucxx vs memcpy; serve: "
        "OpenAI-compatible serving load generator (TTFT/TPOT/ITL, --compare colocated,pd, "
        "--interference, --goodput)",
    )
    p.add_argument("--results-dir", metavar="DIR", help=RESULTS_HELP)
    _add_engine_flags(p)
    _add_transfer_flags(p)
    add_flags(p, EngineConfig)
    add_serve_flags(p)
    return p


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``engine`` (and ``--roofline``) and ``retract``."""
    p.add_argument("--requests", type=int, default=16, help="retract: requests in the workload")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--skip-hf", action="store_true", help="measure this engine only")
    p.add_argument(
        "--roofline",
        action="store_true",
        help="engine: instead of the HF comparison, the roofline: read bandwidth and matmul peak, "
        "decode steps and prefills as fractions of their bounds, a decode step by op class",
    )
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="engine --roofline: dtypes to measure (bfloat16 only on CPUs with AVX512_BF16/AMX; int8: "
        "bfloat16 with --weight-dtype int8, on CPUs with AVX512_BF16)",
    )
    p.add_argument(
        "--prefill-lengths",
        type=int,
        nargs="*",
        default=[128, 512, 2048],
        help="engine --roofline: prompt lengths of the prefill section",
    )
    p.add_argument(
        "--profile-batches",
        type=int,
        nargs="*",
        default=[1, 8],
        help="engine --roofline: decode batch sizes profiled by op class",
    )


def _add_transfer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="nixl,ucxx", help="transfer: data planes to measure (nixl, ucxx)")
    p.add_argument(
        "--ucxx-error-handling",
        choices=["off", "on", "both"],
        default="off",
        help="transfer: ucxx endpoint error handling to measure",
    )
    p.add_argument("--dead-peer", action="store_true", help="transfer: also time a write to a killed peer")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what``; returns the exit status."""
    engine = EngineConfig(**collect(args, EngineConfig))
    if args.what == "serve":
        from bench.serve_bench import run_serve_bench

        return run_serve_bench(args, collect(args, EngineConfig))
    if args.what == "retract":
        from bench.retract_bench import run_retract_bench

        run_retract_bench(engine, args.requests, args.decode_tokens)
    elif args.what == "transfer":
        from bench.transfer_bench import main as transfer_main

        transfer_main(
            ["--backend", args.backend, "--ucxx-error-handling", args.ucxx_error_handling]
            + (["--dead-peer"] if args.dead_peer else [])
        )
    elif args.roofline:
        _run_roofline(args, engine)
    else:
        _run_engine(args, engine)
    return 0


def _run_roofline(args: argparse.Namespace, engine: EngineConfig) -> None:
    from bench.roofline_bench import run_roofline
    from bench.roofline_report import roofline_tables

    dtypes = [d for d in args.dtypes.split(",") if d]
    out = run_roofline(engine, dtypes, args.batch_sizes, args.decode_tokens, args.prefill_lengths, args.profile_batches)
    if args.results_dir:
        r = new_results(
            "engine-roofline",
            "pdserve bench engine --roofline",
            f"Engine against the roofline ({engine.model})",
            command_line(_argv(args)),
            roofline_tables(out),
            read_bandwidth_gbs=out["bandwidth"] / 1e9,
            notes=[f"matmul peak {d}: {p / 1e9:.1f} GFLOP/s ({w})" for d, (p, w) in out["peaks"].items()],
        )
        write_if_asked(args.results_dir, r)


def _run_engine(args: argparse.Namespace, engine: EngineConfig) -> None:
    from bench.engine_bench import engine_tables, run_engine_bench

    out = run_engine_bench(engine, args.batch_sizes, args.decode_tokens, args.prefill_tokens, not args.skip_hf)
    if args.results_dir:
        r = new_results(
            "engine",
            "pdserve bench engine",
            f"Engine against HF transformers ({engine.model}, {engine.dtype})",
            command_line(_argv(args)),
            engine_tables(out, args.batch_sizes, args.prefill_tokens),
        )
        write_if_asked(args.results_dir, r)


def _argv(args: argparse.Namespace) -> list[str]:
    """The arguments after ``pdserve bench`` (``main`` keeps them on ``args``)."""
    return getattr(args, "argv", None) or sys.argv[1:]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in STANDALONE:
        logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return importlib.import_module(STANDALONE[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)
