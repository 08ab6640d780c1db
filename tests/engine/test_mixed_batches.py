"""Mixed batches in the colocated scheduler (tiny random model against transformers): requests
arrive while others decode, so forwards carry decode rows plus a prefill chunk. Greedy outputs
equal transformers', with retracts and radix hits inside mixed steps; every step keeps the pool
invariant (free + used + cached == total) and the token budget; the mixed-steps series moves by
exactly the steps that mixed."""

from __future__ import annotations

import random

import pytest

from configs.scheduler import SchedulerConfig
from configs.schema import load_config
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from engine.scheduler.mixed_step import prefill_budget
from tests.support.metrics_scrape import scrape, val
from tests.support.models import engine_cfg, hf_greedy, sched_cfg
from tests.support.swa import hf_reference, make_llm
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

EOS = 96


def make_sched(tiny, kv_pool_tokens=4096, page_size=4, **sched_kw) -> ColocatedScheduler:
    sched_kw.setdefault("mixed_batches", True)
    cfg, weights, _ = tiny
    runner = ModelRunner(engine_cfg(kv_pool_tokens=kv_pool_tokens, page_size=page_size), cfg, weights)
    return ColocatedScheduler(runner, sched_cfg(**sched_kw), (EOS,))


def prompts(n, lo=3, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, EOS) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n=16):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


class Recorder:
    """Drives a scheduler with requests arriving at given steps; records each forward's (decode
    rows, prefill tokens) and checks the pool invariant after every step."""

    def __init__(self, sched: ColocatedScheduler) -> None:
        self.sched, self.forwards, self.tokens, self.cached = sched, [], {}, {}
        inner = sched.executor.mixed

        def mixed(reqs, items):
            self.forwards.append((len(reqs), sum(i.length for i in items)))
            return inner(reqs, items)

        sched.executor.mixed = mixed

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.sched.add(b"", GenerateRequest(rid=rid, params=params), prompt)
        self.tokens[rid] = []

    def step(self) -> None:
        for d in self.sched.step().outbox.deltas:
            assert d.error is None, d.error
            self.tokens[d.rid] += d.token_ids
            self.cached[d.rid] = max(self.cached.get(d.rid, 0), d.cached_tokens)
        self.sched.check_integrity()  # free + used + cached == total, no page owned twice

    def run(self, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list[int]]:
        n = 0
        while self.sched.has_work or n <= max(arrivals):
            for rid, prompt, params in arrivals.get(n, []):
                self.add(rid, prompt, params)
            self.step()
            n += 1
        return self.tokens


def assert_clean(sched: ColocatedScheduler) -> None:
    sched.check_integrity()
    assert sched.kv.tree is None or sched.kv.tree.protected_size() == 0, "a radix lock was not released"
    usage = sched.kv.usage([])
    assert not sched.requests and usage.used == 0 and usage.free + usage.cached == usage.total


@pytest.fixture(scope="module")
def refs(tiny):
    ps = prompts(6)
    return ps, [hf_greedy(tiny[2], p, 16) for p in ps]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mixed", [True, False])
def test_staggered_arrivals_match_hf(tiny, refs, page_size, mixed):
    """A request every other step, prefill chunks of at most 5, 8 tokens a forward."""
    ps, ref = refs
    sched = make_sched(
        tiny,
        page_size=page_size,
        mixed_batches=mixed,
        chunked_prefill_size=5,
        max_num_batched_tokens=8,
        max_running_requests=4,
    )
    rec = Recorder(sched)
    out = rec.run({2 * i: [(f"r{i}", p, greedy())] for i, p in enumerate(ps)})
    assert [out[f"r{i}"] for i in range(len(ps))] == ref
    both = [f for f in rec.forwards if f[0] and f[1]]
    if mixed:
        assert len(both) == sched.stats.mixed_steps >= 10
        assert all(d + e <= 8 and e <= 5 for d, e in rec.forwards), rec.forwards
    else:
        assert both == [] and sched.stats.mixed_steps == 0
    assert_clean(sched)


def test_retracts_inside_mixed_steps_match_hf(tiny, refs):
    """A 24-page pool under staggered load plus a forced retract every 3 decode steps: victims are
    dropped and re-prefilled, often in the very step that retracted them, beside the decode rows."""
    ps, ref = refs
    sched = make_sched(tiny, kv_pool_tokens=96, retract_test_interval=3, chunked_prefill_size=6)
    rec = Recorder(sched)
    retracted_in_mixed = 0
    inner = rec.step

    def step():
        before, forwards = sched.stats.retractions, len(rec.forwards)
        inner()
        if sched.stats.retractions > before and len(rec.forwards) > forwards and all(rec.forwards[-1]):
            nonlocal retracted_in_mixed
            retracted_in_mixed += 1

    rec.step = step
    out = rec.run({i: [(f"r{i}", p, greedy())] for i, p in enumerate(ps)})
    assert [out[f"r{i}"] for i in range(len(ps))] == ref
    assert retracted_in_mixed >= 2 and sched.stats.retractions >= 3
    assert_clean(sched)


def test_radix_hit_inside_a_mixed_step(tiny):
    """C shares 24 tokens with a finished request; it is admitted while B decodes: its extend row
    starts at the cached prefix in the same forward as B's decode row."""
    cfg, weights, hf = tiny
    base, other = prompts(2, 30, 30, seed=3)
    c_prompt = base[:24] + [5, 6, 7]
    sched = make_sched(tiny, page_size=4)
    rec = Recorder(sched)
    rec.run({0: [("a", base, greedy(8))]})
    rec.add("b", other, greedy(12))
    rec.step()  # B's prefill alone
    rec.add("c", c_prompt, greedy(8))
    rec.step()  # B decodes, C prefills its 3 uncached tokens
    assert rec.forwards[-1] == (1, 3) and sched.stats.mixed_steps == 1
    while sched.has_work:
        rec.step()
    assert rec.cached["c"] == 24 and rec.cached["b"] == 0
    assert rec.tokens["b"] == hf_greedy(hf, other, 12) and rec.tokens["c"] == hf_greedy(hf, c_prompt, 8)
    assert_clean(sched)


def test_token_budget_puts_decode_rows_first(tiny):
    """Chunk 5, budget 5: A (4) and B's first token, then A's decode row and B's last 3; C (10
    tokens) arrives while both decode and gets 3 tokens a step, then 1; then three decode rows."""
    a, b, c = prompts(3, 4, 4, seed=7)[0], prompts(1, 4, 4, seed=8)[0], prompts(1, 10, 10, seed=9)[0]
    sched = make_sched(tiny, chunked_prefill_size=5, max_num_batched_tokens=5, max_running_requests=3)
    rec = Recorder(sched)
    rec.run({0: [("a", a, greedy(20)), ("b", b, greedy(20))], 2: [("c", c, greedy(4))]})
    assert rec.forwards[:7] == [(0, 5), (1, 3), (2, 3), (2, 3), (2, 3), (2, 1), (3, 0)]
    assert_clean(sched)


def test_mixed_steps_series_counts_each_mixed_forward(tiny):
    """A (4 tokens) alone: 1 extend step. B arrives: 1 mixed step. C (10 tokens) arrives while A
    and B decode: 2 mixed steps, of 8 and 2 tokens (the chunk of 8 is below the default budget).
    Nothing else mixes."""
    sched = make_sched(tiny, chunked_prefill_size=8)
    a, b, c = prompts(1, 4, 4, seed=1)[0], prompts(1, 4, 4, seed=2)[0], prompts(1, 10, 10, seed=3)[0]
    rec = Recorder(sched)
    assert val(scrape(sched), "pdserve_worker_mixed_steps_total") == 0
    rec.run({0: [("a", a, greedy())], 1: [("b", b, greedy())], 3: [("c", c, greedy())]})
    m = scrape(sched)
    assert val(m, "pdserve_worker_mixed_steps_total") == 3 and sched.stats.extend_steps == 4
    assert rec.forwards[:6] == [(0, 4), (1, 4), (2, 0), (2, 8), (2, 2), (3, 0)]
    assert_clean(sched)


def test_prefill_budget_is_a_chunk_when_idle_and_a_small_step_beside_decodes():
    """Nothing decoding: a whole chunk. Decoding: the rows the budget leaves, never fewer than the
    decode rows, never more than the chunk. The CPU default bounds a step at 256 rows."""
    cfg = sched_cfg(chunked_prefill_size=512, max_num_batched_tokens=300, max_running_requests=8)
    assert [prefill_budget(cfg, rows) for rows in (0, 8, 200, 400, 600)] == [512, 292, 200, 400, 512]
    cpu = sched_cfg().for_device("cpu")
    assert [prefill_budget(cpu, rows) for rows in (0, 1, 8, 64, 100, 200)] == [512, 255, 248, 192, 156, 200]
    gpu = sched_cfg().for_device("cuda")
    assert [prefill_budget(gpu, rows) for rows in (0, 48)] == [2048, 2000]


def test_seeded_sampling_does_not_depend_on_mixing(tiny):
    ps = prompts(4, seed=11)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    runs = []
    for mixed in (True, False):
        rec = Recorder(make_sched(tiny, mixed_batches=mixed, chunked_prefill_size=7))
        runs.append(rec.run({3 * i: [(f"r{i}", p, sp)] for i, p in enumerate(ps)}))
    assert runs[0] == runs[1]


def test_sliding_window_hybrid_in_mixed_steps_matches_hf(swa_model):
    """Window 8 over a 64-token SWA pool: decode rows release SWA pages behind their window while
    the prefill chunks beside them take new ones; both pools keep their invariant every step."""
    llm = make_llm(
        swa_model, swa=64, chunked_prefill_size=8, max_num_batched_tokens=12, max_running_requests=3, mixed_batches=True
    )
    ps = prompts(4, 20, 40, seed=21)
    rec = Recorder(llm.scheduler)
    out = rec.run({4 * i: [(f"r{i}", p, greedy(12))] for i, p in enumerate(ps)})
    assert [out[f"r{i}"] for i in range(len(ps))] == [hf_reference(swa_model[2], p, 12)[0] for p in ps]
    assert llm.scheduler.stats.mixed_steps >= 8 and all(d + e <= 12 for d, e in rec.forwards)
    assert llm.scheduler.kv.usage([], "swa").used == 0
    assert_clean(llm.scheduler)


def test_budget_defaults_and_config_path():
    cfg = load_config(cli={"max_num_batched_tokens": 256, "mixed_batches": False})
    assert (cfg.scheduler.max_num_batched_tokens, cfg.scheduler.mixed_batches) == (256, False)
    assert SchedulerConfig().mixed_batches is True and SchedulerConfig().max_num_batched_tokens is None
    assert SchedulerConfig().for_device("cpu").max_num_batched_tokens == 256
    assert SchedulerConfig(max_num_batched_tokens=64).for_device("cpu").max_num_batched_tokens == 64
