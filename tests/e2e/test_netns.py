"""PD across emulated hosts: router, prefill and decode each in its own network namespace on a
bridge (one dedicated private /24, see ``netns_hosts``), KV over UCX/TCP between them.

Each host runs ``pdserve launch --roles ...`` (the prefill and decode hosts start only their
worker; the router host only the router, given the workers by DNS name). Per-host /etc/hosts
files play cluster DNS. The scenario, in order:
1. routes are checked before any traffic (every host reaches the others over its eth0, the test
   reaches them over its own veth, no host has a default route);
2. the router starts while ``decode-0`` does not even resolve: /health says 503 and names it;
   once the name resolves, the decode host joins without a router restart (its worker loads
   meanwhile, on a host no name points to yet: the start-ups overlap);
3. greedy outputs through the router equal the colocated engine's, and the prefill host's eth0
   sent at least the KV bytes the workers report (the KV crossed the bridge, not shared memory);
4. the decode host vanishes under load (its link goes down, then its process is killed, so no
   FIN or RST reaches anyone, as when a machine loses power): its requests fail with 503 within
   10 s; decode-0 comes back on another host at another address (its worker starts loading at
   once, as an orchestrator replaces a lost machine; the name moves to it after those 503s); the
   router notices the silent connection, connects again, re-resolves the name and serves.
Every namespace, veth, bridge and hosts file is removed at the end, also on failure.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import httpx
import openai
import pytest

from bench.harness.subprocess_server import REPO_ROOT, metric_sum, wait_idle
from tests.support.models import engine_cfg, sched_cfg, strip_eos
from tests.support.netns_hosts import running_lab, unavailable_reason
from transfer.cluster_key import ClusterKey, write_key_file

_REASON = unavailable_reason()
if _REASON:
    print(f"\n*** SKIPPING the network-namespace test: {_REASON} ***", file=sys.stderr)
pytestmark = [pytest.mark.process, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

HEARTBEAT_S = 0.5
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three primary colors and explain why they are called primary:",
]
NEW_TOKENS = 16
COMMON = [
    "--kv-pool-tokens",
    "2048",
    "--page-size",
    "16",
    "--max-model-len",
    "1024",
    "--health-interval-s",
    str(HEARTBEAT_S),
    "--peer-timeout-s",
    "4",
    "--log-level",
    "WARNING",
]
WORKER = ["--worker-host", "0.0.0.0", "--base-port", "29500"]
# UCX over TCP only, on the namespace's own interface (no shared memory or CMA between "hosts").
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


def pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "server.launch.cli", "launch", *args]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    key = tmp_path_factory.mktemp("netns-key") / "cluster.key"  # each "host" gets --cluster-key FILE
    write_key_file(key, ClusterKey.generate())
    with running_lab(tmp_path_factory.mktemp("netns-logs"), key=key) as lab:
        yield lab


def logs_tail(lab) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(lab.logs.iterdir()))


def start_worker(lab, host: str, role: str):
    env = {**os.environ, **UCX_ENV, "PYTHONPATH": str(REPO_ROOT)}
    return lab.spawn(
        host,
        pdserve("--roles", role, "--advertise-host", f"{role}-0", "--cluster-key", str(lab.key), *WORKER, *COMMON),
        lab.logs / f"{host}.log",
        env=env,
    )


def health(url: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}/health", timeout=5, trust_env=False)
    except httpx.HTTPError:
        return None


def wait_healthy(lab, url: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while (r := health(url)) is None or r.status_code != 200:
        assert time.monotonic() < deadline, f"router not healthy: {r and r.text}\n{logs_tail(lab)}"
        for p in lab.procs:
            assert p.poll() is None or p.returncode in (-9, 137), f"a host process exited\n{logs_tail(lab)}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def colocated(embedded):
    from engine.llm import LLM

    cfg, weights, tok, _ = embedded
    return LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(cfg, weights, tok))


@pytest.fixture(scope="module")
def router_url(lab):
    """The router host's URL; the prefill host (named ``prefill-0``) and the decode host (no name
    yet: ``decode-0`` resolves nowhere) are starting their workers."""
    r_ip, p_ip = lab.add_host("r"), lab.add_host("p")
    lab.add_host("d")
    lab.verify_routes()
    lab.set_name("prefill-0", p_ip)
    start_worker(lab, "p", "prefill")
    start_worker(lab, "d", "decode")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    lab.spawn(
        "r",
        pdserve(
            "--roles",
            "router",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--worker-timeout-s",
            "3",
            "--worker",
            "prefill=prefill-0=tcp://prefill-0:29500",
            "--worker",
            "decode=decode-0=tcp://decode-0:29501",
            "--cluster-key",
            str(lab.key),
            *COMMON,
        ),
        lab.logs / "r.log",
        env=env,
    )
    return f"http://{r_ip}:8000"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        http_client=httpx.Client(trust_env=False, timeout=120),
    )


def greedy(url: str, prompt: str) -> list[int]:
    c = client(url)
    model = c.models.list().data[0].id
    r = c.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    return r.choices[0].token_ids


def test_router_waits_for_a_decode_host_that_does_not_exist_yet(lab, router_url):
    deadline = time.monotonic() + 240
    while (r := health(router_url)) is None or "prefill-0 (prefill): ready" not in r.text:
        assert time.monotonic() < deadline, f"prefill never ready: {r and r.text}\n{logs_tail(lab)}"
        time.sleep(0.5)
    assert r.status_code == 503 and "decode-0 (decode): starting" in r.text
    lab.set_name("decode-0", lab.hosts["d"][1])  # the name resolves only now
    wait_healthy(lab, router_url)


def test_greedy_outputs_across_hosts_equal_colocated(lab, router_url, colocated, embedded):
    from engine.sampling import SamplingParams

    tok = embedded[2]
    tx0 = lab.tx_bytes("p")
    sent0 = metric_sum(wait_idle(router_url, HEARTBEAT_S), "pdserve_kv_transfer_bytes_total")
    for text in PROMPTS:
        ref = colocated.generate_ids([tok.encode(text)], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[
            0
        ].token_ids
        assert strip_eos(greedy(router_url, text), tok.eos_token_ids) == ref, text
    sent = metric_sum(wait_idle(router_url, HEARTBEAT_S), "pdserve_kv_transfer_bytes_total") - sent0
    prompt_tokens = sum(len(tok.encode(t)) for t in PROMPTS)
    assert sent >= prompt_tokens * 30 * 2 * 3 * 64 * 4 * 0.5  # fp32 KV of most prompt tokens
    assert lab.tx_bytes("p") - tx0 >= sent, "the KV did not cross the prefill host's interface"


def test_decode_host_vanishes_then_returns_elsewhere_under_the_same_name(lab, router_url):
    decode_proc = next(p for p in lab.procs if p.args[3] == lab.hosts["d"][0])  # ip netns exec NS ...
    c = openai.AsyncOpenAI(
        base_url=f"{router_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        http_client=httpx.AsyncClient(trust_env=False, timeout=60),
    )

    async def kill_during_load():
        model = (await c.models.list()).data[0].id
        task = asyncio.gather(
            *(
                c.completions.create(
                    model=model, prompt=f"{p} ({i})", max_tokens=400, temperature=0, extra_body={"ignore_eos": True}
                )
                for i, p in enumerate(PROMPTS * 2)
            ),
            return_exceptions=True,
        )
        await asyncio.sleep(2.0)
        t_kill = time.monotonic()
        lab.unplug("d")
        lab.kill(decode_proc)
        new_ip = lab.add_host("d2")  # the replacement loads while the router finds the old one gone
        start_worker(lab, "d2", "decode")
        results = await task
        elapsed = time.monotonic() - t_kill
        await c.close()
        return (results, new_ip), elapsed

    (results, new_ip), elapsed = asyncio.run(kill_during_load())
    errors = [r for r in results if isinstance(r, Exception)]
    odd = [r for r in results if not (isinstance(r, openai.APIStatusError) and r.status_code == 503)]
    assert errors and not odd, [repr(r)[:300] for r in odd]
    assert elapsed < 10
    assert new_ip != lab.hosts["d"][1]
    lab.verify_routes()
    lab.set_name("decode-0", new_ip)
    wait_healthy(lab, router_url)
    assert len(greedy(router_url, PROMPTS[0])) == NEW_TOKENS
