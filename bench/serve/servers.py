"""Servers that ``--compare`` starts itself: ``pdserve launch --mode MODE`` on free loopback ports,
with the same model/pool flags for every mode, stopped (with everything they started) afterwards.
``colocated-xN`` is N colocated replicas behind one router, each pinned to its share of this host's
cores (``--replicas N --worker-cpus auto``): the same hardware as 1P+1D split into colocated copies,
which is what DistServe and SGLang compare a PD split against. A mode may name options after ``+``:
a routing (``pd+cache-aware``) and ``ngram`` (n-gram speculative decoding, ``colocated+ngram``), so
one run compares a server with and without them: a mode without ``+ngram`` launches with
``--speculative-method off`` (speculation is on by default), so ``colocated`` is the plain decode path
and ``colocated,colocated+ngram`` compares it with drafting."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from bench.harness.subprocess_server import LaunchedServer, free_base_port

MODES = ("colocated", "pd", "colocated-xN")
_REPLICATED = re.compile(r"colocated-x([1-9][0-9]*)")  # colocated-x2: two pinned colocated replicas
ROUTINGS = ("least-loaded", "cache-aware")  # a mode may name one: pd+cache-aware launches --routing cache-aware
OPTIONS = {"ngram": ["--speculative-method", "ngram"]}  # colocated+ngram: the same server with n-gram drafts
PLAIN = ["--speculative-method", "off"]  # a mode without +ngram: the plain decode path


def config_flags(values: dict) -> list[str]:
    """``{"kv_pool_tokens": 8192, ...}`` -> ``["--kv-pool-tokens", "8192", ...]`` (None values left out)."""
    flags: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _valid(mode: str) -> bool:
    base, *opts = mode.split("+")
    routings = [o for o in opts if o in ROUTINGS]
    return (
        (base in ("colocated", "pd") or _REPLICATED.fullmatch(base) is not None)
        and all(o in ROUTINGS or o in OPTIONS for o in opts)
        and len(routings) <= 1
        and len(set(opts)) == len(opts)
    )


def parse_modes(text: str) -> list[str]:
    """``"colocated,pd"`` -> ``["colocated", "pd"]`` (``pd+cache-aware``: a mode with its routing;
    ``colocated-x2``: two pinned replicas); ``ValueError`` naming an unknown mode."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if not _valid(m)]
    if bad or not modes or len(set(modes)) != len(modes):
        raise ValueError(
            f"--compare takes distinct modes from {', '.join(MODES)}, each optionally +ROUTING "
            f"({', '.join(ROUTINGS)}) and +OPTION ({', '.join(OPTIONS)}), separated by commas; got {text!r}"
        )
    return modes


def launch_argv(mode: str, flags: list[str]) -> list[str]:
    """``pdserve launch`` arguments for ``mode`` (``pd+cache-aware`` adds ``--routing cache-aware``,
    ``+ngram`` ``--speculative-method ngram``, its absence ``--speculative-method off``;
    ``colocated-xN`` is ``--mode colocated --replicas N --worker-cpus auto``) on an ephemeral HTTP
    port and free worker ports; ``flags`` come last, so they win over what the mode implies."""
    base, *opts = mode.split("+")
    extra = [flag for o in opts for flag in (["--routing", o] if o in ROUTINGS else OPTIONS[o])]
    if "ngram" not in opts:
        extra += PLAIN
    if replicated := _REPLICATED.fullmatch(base):
        base, extra = "colocated", ["--replicas", replicated.group(1), "--worker-cpus", "auto", *extra]
    return [
        "--mode",
        base,
        *extra,
        "--port",
        "0",
        "--base-port",
        str(free_base_port(8)),
        "--log-level",
        "WARNING",
        *flags,
    ]


@contextlib.contextmanager
def launched(mode: str, flags: list[str], startup_timeout_s: float = 300.0) -> Iterator[LaunchedServer]:
    """Start a server in ``mode`` and yield it once it serves (``.url``; ``.pid`` is the launcher,
    which runs the router); stop it on exit (``RuntimeError`` with its log tail if it does not come up)."""
    srv = LaunchedServer(launch_argv(mode, flags), startup_timeout_s=startup_timeout_s)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
