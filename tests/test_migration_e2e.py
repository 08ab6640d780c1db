"""Migration end to end (issue 31): ``pdserve launch`` with 1 prefill + 2 decode worker processes,
KV over NIXL, the real model and HTTP API. ``--route-decode decode-0`` sends every request to one
decode worker whose small pool makes it retract; ``--migrate-after 2`` moves parked requests to
decode-1. Every streamed request ends with the colocated engine's greedy tokens (equal to
transformers, tests/test_pd_http.py) and its usage; a migration happened (metric); nothing is
left in either worker's device or host pool."""
from __future__ import annotations

import asyncio

import openai
import pytest

from conftest import strip_eos
from server.testing.subprocess_server import metric_sum, wait_idle
from transfer.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
SHARED = ("You are a helpful assistant that answers questions about geography, history and science "
          "in one short paragraph. Question: ")
QUESTIONS = ["Why is the sky blue?", "Who built the pyramids?", "What is photosynthesis?",
             "Where is Mount Everest?", "When did the Roman Empire fall?", "How do volcanoes form?",
             "What causes tides?", "Why do leaves change color?"]
NEW_TOKENS = 48


def test_skewed_load_migrates_retracted_requests(launched_server, embedded):
    from engine.llm import LLM
    from conftest import engine_cfg, sched_cfg

    tok = embedded[2]
    colocated = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(embedded[0], embedded[1], tok))
    prompts = [SHARED + q for q in QUESTIONS]
    refs = [colocated.generate_ids([tok.encode(p)], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0]
            .token_ids for p in prompts]
    srv = launched_server("pd", "--decode", "2", "--transfer-backend", "nixl", "--route-decode", "decode-0",
                          "--migrate-after", "2", "--kv-pool-tokens", "384", "--page-size", "16",
                          "--max-model-len", "512", "--init-new-token-ratio", "0.05", "--host-kv-pool-gb", "0.25",
                          "--health-interval-s", str(HEARTBEAT_S), "--worker-timeout-s", "30",
                          "--peer-timeout-s", "4", "--log-level", "WARNING")

    async def one(c, i):
        r = await c.completions.create(model=model, prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
        ids, usage = [], None
        async for chunk in r:
            if chunk.choices:
                ids += getattr(chunk.choices[0], "token_ids", None) or []
            usage = chunk.usage or usage
        return ids, usage

    async def run_all():
        c = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(len(prompts))))
        finally:
            await c.close()

    model = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused").models.list().data[0].id
    results = asyncio.run(run_all())
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs
    assert all(u is not None and u.completion_tokens == len(ids) for ids, u in results)
    m = wait_idle(srv.url, HEARTBEAT_S)
    assert metric_sum(m, "pdserve_retractions_total", worker="decode-0") > 0
    moved = metric_sum(m, "pdserve_migrations_total", worker="decode-0", direction="out", outcome="done")
    assert moved > 0, srv.log()[-4000:]
    assert metric_sum(m, "pdserve_migrations_total", worker="decode-1", direction="in", outcome="done") == moved
    assert metric_sum(m, "pdserve_migration_bytes_total", worker="decode-0") > 0
    assert metric_sum(m, "pdserve_migration_seconds_count", worker="decode-0") == moved
    assert metric_sum(m, "pdserve_requests_total", status="200") == len(prompts)
    for w in ("decode-0", "decode-1"):
        assert metric_sum(m, "pdserve_kv_pool_pages", worker=w, state="used") == 0
        assert metric_sum(m, "pdserve_host_kv_pool_bytes", worker=w, state="used") == 0
        assert metric_sum(m, "pdserve_worker_aborted_requests_total", worker=w) == 0
