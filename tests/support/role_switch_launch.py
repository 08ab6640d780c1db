"""The launch of the live role switch end-to-end tests (the admin path and the SLO planner):
``pdserve launch --mode pd`` with 1 prefill + 2 decode workers and the migration path a decode ->
prefill switch needs (``--migrate-after`` with a bound no request reaches: the switch alone moves
requests), plus the colocated engine's greedy tokens to compare streams with, and the check that a
run left no KV page or host pool byte in use."""

from __future__ import annotations

from bench.harness.subprocess_server import metric_sum
from transfer.wire.sampling_params import SamplingParams

HEARTBEAT_S = 0.2
SWITCHABLE_PD = [
    "--decode",
    "2",
    "--migrate-after",
    "100000",  # the migration path a decode -> prefill switch needs, no migration of its own
    "--host-kv-pool-gb",
    "0.25",
    "--kv-pool-tokens",
    "2048",
    "--health-interval-s",
    str(HEARTBEAT_S),
    "--worker-timeout-s",
    "30",
    "--log-level",
    "INFO",
]
WORKERS = ("prefill-0", "decode-0", "decode-1")


def launch_switchable_pd(launched_server, *extra: str):
    """The launched cluster (``launched_server``: the conftest fixture) with ``extra`` flags on top."""
    return launched_server("pd", *SWITCHABLE_PD, *extra)


def greedy_refs(embedded, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """The colocated engine's greedy tokens of every prompt (``embedded``: the conftest model)."""
    from engine.llm import LLM
    from tests.support.models import engine_cfg, sched_cfg

    tok = embedded[2]
    colocated = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(embedded[0], embedded[1], tok))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    return [colocated.generate_ids([tok.encode(p)], params)[0].token_ids for p in prompts]


def held(m: dict) -> dict[str, float]:
    """What each worker of the launch still holds in ``m``: KV pages used, and host pool bytes used
    on the decode workers (both roles, whatever role each has now); only the non-zero ones."""
    out = {f"{w} pages": metric_sum(m, "pdserve_kv_pool_pages", worker=w, state="used") for w in WORKERS}
    out |= {f"{w} host bytes": metric_sum(m, "pdserve_host_kv_pool_bytes", worker=w, state="used") for w in WORKERS[1:]}
    return {k: v for k, v in out.items() if v}
