"""PD prefill -> decode on a tiny model, in one process (loopback transport, direct message
delivery): greedy outputs equal transformers; decode retract with host offload and resume,
recompute fallback, aborts in every phase, manifest checks; pool invariants after each."""

from __future__ import annotations

import random

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from engine.request import Phase
from engine.scheduler.base import RequestRejected
from engine.scheduler.step_report import StepReport
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # PD in one process against the transformers reference


def run(h: PDHarness, ps, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, params)
    out = h.run()
    return [out[f"r{i}"]["tokens"] for i in range(len(ps))]


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda p=None, d=None: PDHarness(p or pd_cfg(), d or pd_cfg(), tiny[0], tiny[1]))


def test_pd_matches_hf(harness, pd_refs):
    h = harness()
    ps, ref = pd_refs
    assert run(h, ps) == ref
    assert h.prefill.transfer_bytes > 0 and h.decode.stats.retractions == 0


def test_decode_radix_prefix_ships_only_suffix(harness, tiny):
    h = harness()
    base = pd_prompts(1, 24, 24, seed=4)[0]
    run(h, [base])
    shipped = h.prefill.transfer_bytes
    second = base[:16] + [1, 2, 3]
    h.submit("s", second, GREEDY)
    out = h.run()
    assert out["s"]["tokens"] == hf_greedy(tiny[2], second, 16)
    page_bytes = h.p_runner.pool.page_bytes
    assert h.prefill.transfer_bytes - shipped == page_bytes  # tokens 16..18: one page, prefix reused
    assert shipped == 6 * page_bytes
    assert h.decode.stats.cached_prompt_tokens == 16  # the decode radix prefix of the second prompt
    assert h.prefill.stats.cached_prompt_tokens == 16  # the prefill worker's own tree has it too


def test_retract_offload_and_resume(harness, tiny):
    # 4 requests of 20 + 16 tokens (9 pages each at the end) in a 24-page decode pool admitted
    # with a low new_token_ratio: decode must retract; the host pool keeps the KV.
    h = harness(d=pd_cfg(pool=96, init_new_token_ratio=0.1))
    ps = pd_prompts(4, 20, 20, seed=21)
    assert run(h, ps) == [hf_greedy(tiny[2], p, 16) for p in ps]
    rs = h.decode.retract.stats
    assert h.decode.stats.retractions > 0 and rs.offloaded > 0 and rs.resumed == rs.offloaded
    assert rs.recomputed == 0


def test_retract_least_output_first_in_pd(harness, tiny, monkeypatch):
    # --retract-order least-output (SGLang's code order), staggered arrivals: each retract takes the
    # running requests with the least output first; outputs stay exact, every parked request resumes
    import engine.scheduler.running_batch as rb

    h = harness(d=pd_cfg(pool=96, init_new_token_ratio=0.1, retract_order="least-output"))
    ps = pd_prompts(4, 20, 20, seed=21)
    rounds, real = [], rb.retract_decode

    def recorded(kv, running, *a, **kw):
        res = real(kv, running, *a, **kw)
        rounds.append(
            (kw["retract_order"], [len(q.output_ids) for q in res.retracted], [len(q.output_ids) for q in res.kept])
        )
        return res

    monkeypatch.setattr(rb, "retract_decode", recorded)
    got = {f"r{i}": [] for i in range(4)}
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY)
        for _ in range(4):
            for d in h.step():
                got[d.rid] += d.token_ids
    for rid, r in h.run().items():
        got[rid] += r["tokens"]
    assert [got[f"r{i}"] for i in range(4)] == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert h.decode.retract.stats.resumed == h.decode.retract.stats.offloaded > 0
    taken = [r for r in rounds if r[1]]
    assert taken and all(order == "least-output" for order, _, _ in rounds)
    assert all(max(victims) <= min(kept, default=99) for _, victims, kept in taken), taken
    assert any(max(victims) < max(kept, default=0) for _, victims, kept in taken), taken  # an order mattered


def test_forced_retract_in_pd(harness, pd_refs):
    h = harness(d=pd_cfg(retract_test_interval=3))
    ps, ref = pd_refs
    assert run(h, ps) == ref
    assert h.decode.retract.stats.resumed > 0


def test_host_pool_full_falls_back_to_recompute(harness, tiny):
    h = harness(d=pd_cfg(pool=96, host_gb=0.0, init_new_token_ratio=0.1))
    ps = pd_prompts(4, 20, 20, seed=21)
    assert run(h, ps) == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert h.decode.retract.stats.recomputed > 0 and h.decode.retract.stats.offloaded == 0


def test_host_pool_too_small_for_all_victims(harness, tiny):
    # room for 8 host pages: some victims are offloaded, the rest recomputed; nothing is lost
    c = tiny[0]
    page_bytes = c.num_layers * 2 * 4 * c.num_kv_heads * c.head_dim * 4  # page 4, fp32
    h2 = harness(d=pd_cfg(pool=96, host_gb=8 * page_bytes / 2**30, init_new_token_ratio=0.1))
    ps = pd_prompts(6, 18, 22, seed=41)
    assert run(h2, ps) == [hf_greedy(tiny[2], p, 16) for p in ps]
    rs = h2.decode.retract.stats
    assert rs.offloaded > 0 and rs.recomputed > 0 and rs.resumed == rs.offloaded
    assert h2.decode.retract.host.num_pages == 8


def test_abort_in_retracted_queue_frees_host_pages(harness):
    h = harness(d=pd_cfg(pool=96, init_new_token_ratio=0.1))
    ps = pd_prompts(4, 20, 20, seed=21)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, SamplingParams(max_new_tokens=40, temperature=0))
    for _ in range(500):
        h.step()
        if h.decode.retract.queue:
            break
    assert h.decode.retract.queue, "expected a retracted request"
    host = h.decode.retract.host
    assert host.num_free() < host.num_pages
    for i in range(4):
        h.decode.abort(f"r{i}")
        h.prefill.abort(f"r{i}")
    h.run()
    assert host.num_free() == host.num_pages


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_abort_in_each_phase(harness, steps_before_abort):
    h = harness()
    h.submit("a", pd_prompts(1, 30, 30, seed=2)[0], SamplingParams(max_new_tokens=30, temperature=0))
    for _ in range(steps_before_abort):
        h.step()
    ev = h.decode.abort("a").deltas
    assert ev and ev[0].finish_reason == "abort"
    assert not h.decode.abort("a")  # idempotent
    h.prefill.abort("a")
    h.run()


def test_manifest_mismatch_fails_request(harness, monkeypatch):
    h = harness()
    from prefill_worker import scheduler as ps_mod

    real = ps_mod.PrefillScheduler._manifest

    def corrupt(self, job, ev):
        return real(self, job, ev).model_copy(update={"n_tokens": job.req.kv_len + 1})

    monkeypatch.setattr(ps_mod.PrefillScheduler, "_manifest", corrupt)
    h.submit("x", pd_prompts(1, 10, 10)[0], GREEDY)
    out = h.run()
    assert out["x"]["finish"] == "abort" and "manifest" in out["x"]["error"]
    assert h.decode.snapshot().counters["transfer_failures"] == 1


def test_too_long_for_decode_pool_refused(harness):
    h = harness(d=pd_cfg(pool=64))
    with pytest.raises(RequestRejected, match="decode KV cache pool capacity of 64"):
        h.decode.add(b"r", GenerateRequest(rid="big", params=GREEDY, room=1, prefill_addr="x"), list(range(60)))


def test_last_request_waits_for_pages_a_transfer_holds(harness, tiny):
    # A transfer in flight holds its reserved pages (they may still be written): the running
    # request cannot take them and, alone, cannot grow. It is parked in the retracted queue (not
    # aborted: the pages come back without its progress) and resumes, exact, once b is done.
    h = harness(d=pd_cfg(pool=64, init_new_token_ratio=0.05))
    pa = pd_prompts(1, 8, 8, seed=3)[0]
    h.submit("a", pa, SamplingParams(max_new_tokens=40, temperature=0))
    early = []
    for _ in range(3):
        early += [t for d in h.step() for t in d.token_ids]
    assert len(h.decode.running)
    h.submit("b", pd_prompts(1, 40, 40, seed=4)[0], SamplingParams(max_new_tokens=4, temperature=0))
    real_step = h.prefill.step
    h.prefill.step = lambda: StepReport()  # prefill worker stalls: b's KV does not arrive yet
    for _ in range(60):
        early += [t for d in h.step() if d.rid == "a" for t in d.token_ids]
        if h.decode.retract.queue:
            break
    assert [j.req.rid for j in h.decode.retract.queue] == ["a"] and not h.decode.running
    h.prefill.step = real_step
    out = h.run()
    assert out["b"]["finish"] == "length" and len(out["b"]["tokens"]) == 4
    assert out["a"]["finish"] == "length" and early + out["a"]["tokens"] == hf_greedy(tiny[2], pa, 40)
    assert h.decode.running.stats.oom_aborts == 0 and h.decode.running.stats.retractions >= 1


def test_silent_prefill_peer_fences_pages_until_late_write(harness):
    # The decode side gives up on a silent prefill worker (client answered at once) but keeps the
    # destination pages: the late write lands in them, then they are freed. Never reused early.
    h = harness()
    h.submit("s", pd_prompts(1, 30, 30, seed=6)[0], GREEDY)
    real_step = h.prefill.step
    h.prefill.step = lambda: StepReport()  # prefill worker stalls before writing
    for _ in range(3):
        h.step()
    assert "s" in h.decode.jobs and h.decode.jobs["s"].req.status is Phase.TRANSFER
    h.heartbeats = False
    h.decode.peers.get("inproc://p").last_seen -= 3600  # silent for an hour: the next tick declares it dead
    events = [e for e in h.step() if e.finish_reason]
    assert [(e.rid, e.error_status) for e in events] == [("s", 503)]
    held = h.decode.kv.usage(h.decode.live_handles()).used
    assert held > 0  # fenced, not freed
    h.prefill.step, h.heartbeats = real_step, True
    h.run()  # the late write and its notification arrive; now the pages go back
    assert h.decode.kv.usage([]).used == 0 and not h.decode.jobs


def _decode_only(h: PDHarness, rid: str, prompt: list[int], room: int) -> None:
    """The router's GenerateRequest reaches the decode worker; its PrefillRequest is not sent (yet)."""
    from bench.harness.pd_harness import PREFILL_ADDR, ROUTER

    msg = GenerateRequest(rid=rid, params=GREEDY, room=room, prefill_addr=PREFILL_ADDR)
    h.deliver(h.decode.add(ROUTER, msg, prompt), True)


def test_destination_that_comes_before_its_prompt_is_kept(harness, tiny):
    from bench.harness.pd_harness import ROUTER
    from transfer.wire.outbox import Conn
    from transfer.wire.protocol import PrefillRequest, ids_frame

    h = harness()
    p = pd_prompts(1, 12, 12, seed=9)[0]
    _decode_only(h, "e", p, room=77)
    for _ in range(3):
        h.step()  # handshake, admission: the KVDestination reaches the prefill worker first
    assert (77, 0) in h.prefill.bootstrap.early
    msg = PrefillRequest(rid="e", room=77, params=GREEDY, decode_worker="d0")
    h.router_inbox += h.deliver(h.prefill.handle(Conn(ROUTER), msg, [ids_frame(p)]), False)
    assert h.run()["e"]["tokens"] == hf_greedy(tiny[2], p, 16)


def test_destination_whose_prompt_never_comes_is_answered_after_the_grace(harness, monkeypatch):
    from prefill_worker import bootstrap

    monkeypatch.setattr(bootstrap, "GRACE_S", 0.0)
    h = harness()
    _decode_only(h, "o", pd_prompts(1, 12, 12, seed=9)[0], room=78)
    out = h.run()
    assert out["o"]["finish"] == "abort" and "no such request" in out["o"]["error"]
    assert not h.prefill.bootstrap.early


def test_seeded_sampling_is_the_same_in_every_mode_and_across_retracts(harness, tiny):
    # the decode worker builds a fresh sampler state after the prefill worker drew
    # token 0; the stream must still equal colocated mode's, with offload and with recompute.
    from engine.llm import run_batch
    from engine.model_runner import ModelRunner
    from engine.scheduler.colocated import ColocatedScheduler
    from tests.support.models import engine_cfg, sched_cfg

    ps = pd_prompts(4, 20, 20, seed=21)
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_k=40, seed=7 + i) for i in range(4)]

    def pd(**d):
        h = harness(d=pd_cfg(**d))
        for i, p in enumerate(ps):
            h.submit(f"r{i}", p, params[i])
        out = h.run()
        return [out[f"r{i}"]["tokens"] for i in range(4)], h.decode.retract.stats

    def colocated(**sched):
        runner = ModelRunner(engine_cfg(kv_pool_tokens=sched.pop("pool", 4096), page_size=4), tiny[0], tiny[1])
        s = ColocatedScheduler(runner, sched_cfg(**sched), ())
        return [d.token_ids for d in run_batch(s, ps, params)], s.running.stats.retractions

    ref, _ = colocated()
    assert len({tuple(t) for t in ref}) == 4 and all(len(t) == 16 for t in ref)
    dropped, n_retract = colocated(pool=96, init_new_token_ratio=0.1)  # drop and recompute
    assert dropped == ref and n_retract > 0
    plain, _ = pd()
    offload, s_off = pd(pool=96, init_new_token_ratio=0.1)
    recompute, s_rec = pd(pool=96, host_gb=0.0, init_new_token_ratio=0.1)
    assert plain == ref and offload == ref and recompute == ref
    assert s_off.offloaded > 0 and s_rec.recomputed > 0


def test_slow_steps_never_make_the_in_process_prefill_peer_dead(harness, pd_refs, monkeypatch):
    """Wall time between steps beyond peer_timeout_s (a loaded machine) does not fail requests:
    the harness hands the decode side a heartbeat reply each step, as the worker loop's pinger
    thread does for a live peer. Without it every request ended empty ("did not answer")."""
    import time

    slow = pd_cfg()
    slow.cluster.peer_timeout_s, slow.cluster.progress_timeout_s = 0.05, 30.0
    h = harness(d=slow)
    ps, ref = pd_refs
    real_step = h.step

    def slow_step():
        time.sleep(0.06)
        return real_step()

    monkeypatch.setattr(h, "step", slow_step)
    assert run(h, ps[:2]) == ref[:2]


def test_small_pools_with_recomputes_never_deadlock(harness, seed=0):
    """Both pools at 24 pages, 16 requests at once, every retract a recompute (no host pool) and one
    forced every 4 decode steps. Before prefill waited for its decode destination, the prefill pool
    filled with finished KV the decode worker had no room to ask for, while the decode pool was
    held by the destinations of recomputes queued behind it on the prefill side: nothing moved
    until ``bootstrap_timeout_s``. Now every request ends with all its tokens."""
    p = pd_cfg(pool=384, page=16, host_gb=0)
    d = pd_cfg(pool=384, page=16, host_gb=0, init_new_token_ratio=0.05, retract_test_interval=4)
    h = harness(p, d)
    rng = random.Random(seed)
    ps = pd_prompts(16, 40, 80, seed=seed)
    params = [SamplingParams(max_new_tokens=rng.choice([32, 64]), temperature=0, ignore_eos=True) for _ in ps]
    for i, (prompt, sp) in enumerate(zip(ps, params)):
        h.submit(f"r{i}", prompt, sp)
    out = h.run(max_steps=5000)
    assert [(out[f"r{i}"]["error"], len(out[f"r{i}"]["tokens"])) for i in range(len(ps))] == [
        (None, sp.max_new_tokens) for sp in params
    ]
    assert h.decode.stats.retractions > 0 and h.prefill.stats.finished_requests > len(ps)  # recomputes ran
