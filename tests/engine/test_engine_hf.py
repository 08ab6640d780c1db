"""The embedded model matches HuggingFace transformers token for token (greedy, one batch)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the embedded model against transformers

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "In 1969, Apollo 11 landed on the Moon. The astronauts on board were Neil Armstrong, Buzz Aldrin "
    "and Michael Collins. Summarize the mission in one sentence, mentioning the date, the crew and "
    "what made it historic for humanity:",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_reference(embedded, hf_embedded):
    tok = embedded[2]
    refs = []
    for text in PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            out = hf_embedded.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        new = out[0, len(ids) :].tolist()
        refs.append((ids, [t for t in new if t not in tok.eos_token_ids]))
    return refs


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_batch_matches_transformers(embedded, hf_reference, page_size):
    cfg, weights, tok, _ = embedded
    llm = LLM(engine_cfg(page_size=page_size, kv_pool_tokens=2048), sched_cfg(), loaded=(cfg, weights, tok))
    prompts = [ids for ids, _ in hf_reference]
    results = llm.generate_ids(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must have different lengths"
    for res, (_, ref) in zip(results, hf_reference):
        assert res.token_ids == ref
        assert res.finish_reason in ("length", "stop")
    llm.scheduler.check_integrity()
    usage = llm.scheduler.kv.usage([])
    assert usage.used == 0 and usage.free + usage.cached == usage.total


def test_generate_cli_json_matches_transformers(embedded, hf_reference, capsys):
    from server.launch.cli import main

    ids, ref = hf_reference[0]
    rc = main(
        ["generate", "--prompt", PROMPTS[0], "--max-tokens", str(NEW_TOKENS), "--json", "--kv-pool-tokens", "1024"]
    )
    assert rc == 0
    import json

    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_token_ids"] == ids
    assert out["token_ids"] == ref
    assert out["finish_reason"] in ("length", "stop")
    assert out["text"] == embedded[2].decode(ref)


def test_staggered_mixed_batches_match_transformers(embedded, hf_reference):
    """Prompts arrive one every 3 steps while earlier ones decode, prefilled 16 tokens at a time in
    forwards of at most 24 tokens: every prefill chunk but the first rides with decode rows."""
    from transfer.wire.protocol import GenerateRequest

    cfg, weights, tok, _ = embedded
    llm = LLM(
        engine_cfg(page_size=16, kv_pool_tokens=2048),
        sched_cfg(chunked_prefill_size=16, max_num_batched_tokens=24, max_running_requests=4, mixed_batches=True),
        loaded=(cfg, weights, tok),
    )
    sched, got, step = llm.scheduler, {}, 0
    while sched.has_work or step < 3 * len(hf_reference):
        if step % 3 == 0 and step // 3 < len(hf_reference):
            i = step // 3
            sched.add(
                b"",
                GenerateRequest(rid=f"r{i}", params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)),
                hf_reference[i][0],
            )
            got[f"r{i}"] = []
        for d in sched.step().outbox.deltas:
            got[d.rid] += d.token_ids
        sched.check_integrity()
        step += 1
    assert [got[f"r{i}"] for i in range(len(hf_reference))] == [ref for _, ref in hf_reference]
    assert sched.stats.mixed_steps == sched.stats.extend_steps - 1 >= 6  # every chunk after the first had company
    usage = sched.kv.usage([])
    assert usage.used == 0 and usage.free + usage.cached == usage.total
