"""The stop token travels with the last delta (``TokenDelta.stop_token_id`` and its logprobs) in
every mode, so the router can count it as vLLM does: sampled on the prefill worker (the first
token, shipped with the manifest), on the decode worker, and colocated. Tiny random model."""

from __future__ import annotations

from bench.harness.pd_harness import PDHarness
from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, hf_greedy, sched_cfg
from tests.support.pd import pd_cfg
from transfer.wire.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 8, 63, 21, 9, 30, 77, 12]


def _pd_deltas(tiny, params: SamplingParams) -> list:
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    try:
        h.submit("r", PROMPT, params)
        deltas = []
        for _ in range(1000):
            if not h.busy:
                break
            deltas += [d for d in h.step() if d.rid == "r"]
        h.check_clean()
        return deltas
    finally:
        h.close()


def test_stop_token_on_prefill_and_decode_side(tiny):
    ref = hf_greedy(tiny[2], PROMPT, 3)
    assert ref[0] != ref[1]  # else the second case would stop on the first token too
    for k in (0, 1):  # k = 0: the first token (prefill worker) stops it; k = 1: a decode-side token does
        params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(ref[k],), logprobs=1)
        deltas = _pd_deltas(tiny, params)
        last = deltas[-1]
        assert [t for d in deltas for t in d.token_ids] == ref[:k]
        assert last.finish_reason == "stop" and last.token_ids == [] and last.stop_token_id == ref[k]
        assert last.stop_logprob is not None and last.stop_logprob <= 0
        assert last.stop_top_logprobs[0][0] == ref[k]  # greedy: the stop token is the top one


def test_stop_token_colocated(tiny):
    ref = hf_greedy(tiny[2], PROMPT, 3)
    runner = ModelRunner(engine_cfg(kv_pool_tokens=4096, page_size=4), tiny[0], tiny[1])
    s = ColocatedScheduler(runner, sched_cfg(), ())
    params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(ref[1],))
    (out,) = run_batch(s, [PROMPT], [params])
    assert out.token_ids == ref[:1] and out.finish_reason == "stop" and out.stop_token_id == ref[1]
    (out,) = run_batch(s, [PROMPT], [SamplingParams(max_new_tokens=2, temperature=0)])
    assert out.token_ids == ref[:2] and out.finish_reason == "length" and out.stop_token_id is None
