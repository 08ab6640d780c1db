"""Flags of ``pdserve bench serve`` and their parsing into a typed ``ServeOptions``.

The flags join the ``pdserve bench`` parser in their own group; the engine flags that parser already
has (``--model``, ``--kv-pool-tokens``, ...) are what ``--compare`` passes to every server it launches.
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass

from bench.serve.client import split_urls
from bench.serve.goodput import DEFAULT_ATTAINMENT, GoodputSpec
from bench.serve.multiturn import MultiTurnSpec
from bench.serve.servers import parse_modes
from bench.serve.stats import SLO
from bench.serve.workload import WORKLOADS

DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 128, 64
# --goodput's knobs: flag -> (argparse dest, default); given without --goodput they are refused.
GOODPUT_KNOBS = {
    "--slo-attainment": ("slo_attainment", DEFAULT_ATTAINMENT),
    "--goodput-start-rate": ("goodput_start_rate", 1.0),
    "--goodput-max-rate": ("goodput_max_rate", 64.0),
    "--goodput-iters": ("goodput_iters", 4),
    "--goodput-min-step": ("goodput_min_step", 0.05),
}


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Add the ``bench serve`` flags to ``p``, in one group."""
    g = p.add_argument_group("bench serve (OpenAI-compatible load generator)")
    _target_flags(g)
    _load_flags(g)
    _lengths_flags(g)
    _goodput_flags(g)
    _output_flags(g)
    _compare_flags(g)
    _interference_flags(g)
    _multiturn_flags(g)


def _target_flags(g) -> None:
    """The server loaded and how requests reach it."""
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server to load (without /v1); several comma-separated (routers in front of the same "
        "workers): requests go round-robin across them, e.g. http://h:8000,http://h:8001",
    )
    g.add_argument("--served-model-name", help="model field of the requests; default: first of GET /v1/models")
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")


def _load_flags(g) -> None:
    """Closed loop (clients) or open loop (Poisson rates), and how many requests."""
    g.add_argument("--concurrency", help="closed loop: comma-separated client counts, e.g. 1,8,32 (default 1)")
    g.add_argument("--request-rate", help="open loop: comma-separated Poisson rates in req/s, e.g. 1,2,inf")
    g.add_argument(
        "--num-prompts",
        "--num-requests",
        type=int,
        default=32,
        help="measured requests per load level (per probed rate with --goodput)",
    )
    g.add_argument(
        "--prompts-per-client",
        type=int,
        help="closed loop: measure N requests per client at each level (N x concurrency in all, "
        "instead of --num-prompts), so every level reaches a steady state rather than "
        "one burst of concurrency requests that drains",
    )


def _lengths_flags(g) -> None:
    """Prompt and output lengths, the tokenizer that counts them, warm-up and seed."""
    g.add_argument("--input-len", type=int, help=f"prompt tokens (see --input-len-range; default {DEFAULT_INPUT_LEN})")
    g.add_argument(
        "--input-len-range", metavar="LO,HI", help="prompt tokens uniform in [LO, HI] (wins over --input-len)"
    )
    g.add_argument("--output-len", type=int, help=f"max_tokens of every request (default {DEFAULT_OUTPUT_LEN})")
    g.add_argument(
        "--output-len-range", metavar="LO,HI", help="max_tokens uniform in [LO, HI] (wins over --output-len)"
    )
    g.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="; ".join(w.about for w in WORKLOADS.values()) + " (instead of the length flags)",
    )
    g.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens (ignore_eos, as vLLM and pdserve accept)",
    )
    g.add_argument(
        "--tokenizer",
        help="model spec whose tokenizer counts prompt tokens ('words': one word "
        "= one token); default: --model, else the embedded model",
    )
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each load level's run")
    g.add_argument("--workload-seed", type=int, default=0, help="seed of prompts and arrival times")


def _goodput_flags(g) -> None:
    """SLOs and the --goodput search."""
    g.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT target")
    g.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT target")
    g.add_argument(
        "--goodput",
        action="store_true",
        help="search each target's goodput: the highest Poisson rate at which --slo-attainment of "
        "--num-requests requests meet both --slo-ttft-ms and --slo-tpot-ms (double from "
        "--goodput-start-rate until a rate fails, then bisect)",
    )
    g.add_argument(
        "--slo-attainment",
        type=float,
        help=f"--goodput: share of requests that must meet both SLOs (default {DEFAULT_ATTAINMENT})",
    )
    g.add_argument("--goodput-start-rate", type=float, help="--goodput: first rate tried, req/s (default 1)")
    g.add_argument("--goodput-max-rate", type=float, help="--goodput: doubling stops here, req/s (default 64)")
    g.add_argument(
        "--goodput-iters",
        type=int,
        help="--goodput: bisection probes after the first failing rate, at most (default 4)",
    )
    g.add_argument(
        "--goodput-min-step",
        type=float,
        help="--goodput: stop bisecting once the passing and failing rates are this close, req/s (default 0.05)",
    )


def _output_flags(g) -> None:
    """Timeouts and what is written (JSON, PNG, progress)."""
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g.add_argument("--out", "--json-out", dest="out", help="write the results as JSON here")
    g.add_argument("--plot", help="write a PNG of latency and throughput against load here (needs matplotlib)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _compare_flags(g) -> None:
    """Launched modes and other running servers in the same run."""
    g.add_argument(
        "--compare",
        help="launch these modes one after the other (e.g. colocated,pd; colocated-x2: two "
        "colocated replicas pinned to their share of the cores; +cache-aware or +least-loaded: "
        "that routing; +ngram: n-gram speculative decoding) with the same engine "
        "flags and run the same workload against each; prints the ratios",
    )
    g.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="also load this running server (e.g. vllm=http://127.0.0.1:8100) in the same run, "
        "after the --compare modes; repeatable; ratios are against the first target. URL may "
        "be several comma-separated routers, loaded round-robin (two=http://h:8000,http://h:8001)",
    )
    g.add_argument("--server-args", default="", help="--compare: more 'pdserve launch' flags for every server")


def _interference_flags(g) -> None:
    """--interference: long prompts among short requests."""
    g.add_argument(
        "--interference",
        action="store_true",
        help="short requests at --request-rate (Poisson) plus --long-prompts long ones at random",
    )
    g.add_argument("--long-prompts", type=int, default=4, help="--interference: number of long prompts")
    g.add_argument("--long-input-len-range", default="1500,2000", metavar="LO,HI")
    g.add_argument("--long-output-len", type=int, default=16)
    g.add_argument("--long-request-rate", type=float, help="default: spread over the short stream's duration")


def _multiturn_flags(g) -> None:
    """--multi-turn conversations."""
    g.add_argument(
        "--multi-turn",
        action="store_true",
        help="multi-turn chat: --users conversations of --turns turns, each turn resending the "
        "conversation so far (an --input-len opening, the answers, --turn-input-len questions) "
        "after --think-time-s; reports TTFT per turn, prefix hit rate per side, KV bytes shipped",
    )
    g.add_argument("--users", type=int, default=16, help="--multi-turn: concurrent conversations")
    g.add_argument("--turns", type=int, default=6, help="--multi-turn: turns per conversation")
    g.add_argument("--turn-input-len", type=int, default=64, help="--multi-turn: tokens of each new question")
    g.add_argument(
        "--think-time-s",
        type=float,
        default=1.0,
        help="--multi-turn: mean pause between a user's turns (exponential; 0: none)",
    )
    g.add_argument(
        "--user-arrival-s",
        type=float,
        default=0.0,
        help="--multi-turn: mean gap between users' first turns (exponential, seeded; 0: every user starts at once)",
    )


def _range(text: str, flag: str) -> tuple[int, int]:
    parts = text.replace("-", ",").split(",")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"{flag} takes LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _numbers(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{flag} takes comma-separated numbers > 0, got {text!r}")
    return values


def parse_targets(specs: list[str], compare: str | None) -> tuple[tuple[str, str], ...]:
    """``["vllm=http://h:8100"]`` -> ``(("vllm", "http://h:8100"),)``; ``ValueError`` naming ``--target``
    for a malformed spec or a name used twice (also against the ``--compare`` modes)."""
    out: list[tuple[str, str]] = []
    taken = set(parse_modes(compare)) if compare else set()
    for spec in specs:
        name, _, url = spec.partition("=")
        name, url = name.strip(), url.strip()
        if not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--target takes NAME=http://HOST:PORT[,http://HOST2:PORT2...], got {spec!r}")
        url = ",".join(split_urls(url, "--target"))
        if name in taken:
            raise ValueError(f"--target name {name!r} is used twice; give each target its own name")
        taken.add(name)
        out.append((name, url))
    return tuple(out)


def _lengths(a: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    """(prompt, output) token ranges from ``--workload`` or the length flags (not both)."""
    given = [
        f
        for f, v in (
            ("--input-len", a.input_len),
            ("--input-len-range", a.input_len_range),
            ("--output-len", a.output_len),
            ("--output-len-range", a.output_len_range),
        )
        if v is not None
    ]
    if a.workload is not None:
        if given:
            raise ValueError(
                f"--workload {a.workload} sets the prompt and output lengths itself: drop "
                f"{', '.join(given)} (or drop --workload)"
            )
        return WORKLOADS[a.workload].input_range, WORKLOADS[a.workload].output_range
    inp = (
        _range(a.input_len_range, "--input-len-range")
        if a.input_len_range
        else _range(str(DEFAULT_INPUT_LEN if a.input_len is None else a.input_len), "--input-len")
    )
    out = (
        _range(a.output_len_range, "--output-len-range")
        if a.output_len_range
        else _range(str(DEFAULT_OUTPUT_LEN if a.output_len is None else a.output_len), "--output-len")
    )
    return inp, out


def _goodput(a: argparse.Namespace, slo: SLO) -> GoodputSpec | None:
    """The ``--goodput`` search settings; ``ValueError`` for a knob without ``--goodput`` or a load
    flag with it (the search picks the rates itself)."""
    given = [flag for flag, (dest, _) in GOODPUT_KNOBS.items() if getattr(a, dest) is not None]
    if not a.goodput:
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --goodput")
        return None
    clash = [
        f
        for f, v in (
            ("--concurrency", a.concurrency),
            ("--request-rate", a.request_rate),
            ("--interference", a.interference),
            ("--multi-turn", a.multi_turn),
            ("--prompts-per-client", a.prompts_per_client),
        )
        if v
    ]
    if clash:
        raise ValueError(
            f"--goodput picks the request rates itself (from --goodput-start-rate): drop {', '.join(clash)}"
        )
    knobs = {
        dest: default if getattr(a, dest) is None else getattr(a, dest) for dest, default in GOODPUT_KNOBS.values()
    }
    return GoodputSpec(
        slo,
        knobs["slo_attainment"],
        knobs["goodput_start_rate"],
        knobs["goodput_max_rate"],
        knobs["goodput_iters"],
        knobs["goodput_min_step"],
    )


def _refuse_clashes(a: argparse.Namespace) -> None:
    """``ValueError`` for load flags that exclude each other (each run has one kind of load)."""
    if a.workload and (a.multi_turn or a.interference):
        raise ValueError(
            "--workload shapes a --concurrency, --request-rate or --goodput run; --multi-turn and "
            "--interference have their own lengths: drop --workload"
        )
    if a.multi_turn and (a.concurrency or a.request_rate or a.interference):
        raise ValueError(
            "--multi-turn sets its own load (--users conversations): drop --concurrency, "
            "--request-rate and --interference"
        )
    if a.concurrency and a.request_rate:
        raise ValueError("give --concurrency (closed loop) or --request-rate (open loop), not both")
    if a.interference and a.concurrency:
        raise ValueError("--interference is open loop: give the short requests' --request-rate, not --concurrency")


@dataclass(frozen=True)
class ServeOptions:
    """Parsed, validated ``bench serve`` settings (``ValueError`` from ``from_args`` says which flag is wrong)."""

    concurrency: list[int] | None
    request_rates: list[float] | None
    input_range: tuple[int, int]
    long_range: tuple[int, int]
    slo: SLO
    modes: list[str] | None
    server_args: list[str]
    targets: tuple[tuple[str, str], ...] = ()
    multi_turn: MultiTurnSpec | None = None
    output_range: tuple[int, int] = (DEFAULT_OUTPUT_LEN, DEFAULT_OUTPUT_LEN)
    goodput: GoodputSpec | None = None
    instruction: str = ""  # --workload's task after every prompt (PromptShape.instruction)

    @property
    def target_names(self) -> list[str]:
        """Every target in run order: the launched modes, then the ``--target`` servers."""
        return [*(self.modes or []), *(name for name, _ in self.targets)]

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> ServeOptions:
        slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
        goodput = _goodput(a, slo)
        _refuse_clashes(a)
        conc = _numbers(a.concurrency, "--concurrency", int) if a.concurrency else None
        rates = _numbers(a.request_rate, "--request-rate", float) if a.request_rate else None
        if a.interference and (rates is None or len(rates) != 1 or math.isinf(rates[0])):
            raise ValueError("--interference needs one finite --request-rate for the short requests, e.g. 1.0")
        if conc is None and rates is None and goodput is None:
            conc = [1]
        if a.prompts_per_client is not None and (conc is None or a.prompts_per_client < 1):
            raise ValueError("--prompts-per-client takes a number >= 1 and needs --concurrency (closed loop)")
        split_urls(a.base_url, "--base-url")
        if a.num_prompts < 1 or a.warmup < 0:
            raise ValueError("--num-prompts must be >= 1, --warmup >= 0")
        inp, out = _lengths(a)
        if (a.multi_turn or a.interference) and out[0] != out[1]:
            raise ValueError(
                "--output-len-range applies to --concurrency, --request-rate and --goodput runs: give --output-len"
            )
        multi = (
            MultiTurnSpec(a.users, a.turns, inp[0], a.turn_input_len, out[0], a.think_time_s, a.user_arrival_s)
            if a.multi_turn
            else None
        )
        return cls(
            conc,
            rates,
            inp,
            _range(a.long_input_len_range, "--long-input-len-range"),
            slo,
            parse_modes(a.compare) if a.compare else None,
            shlex.split(a.server_args),
            parse_targets(a.target, a.compare),
            multi,
            out,
            goodput,
            WORKLOADS[a.workload].instruction if a.workload else "",
        )
