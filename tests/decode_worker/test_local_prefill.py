"""Selective disaggregation (``--local-prefill-max-tokens``) in one process: the real prefill and
decode schedulers of the PD harness. Off and on, greedy outputs equal transformers; taken requests
never reach the prefill worker's compute (no KV written) whichever of the router's
``PrefillRequest`` and the decode worker's ``PrefillWithdrawn`` comes first; a second turn whose
prefix the decode radix cache holds is prefilled locally; SWA pools; forced retracts (offload and
recompute); an abort mid local prefill; the decision's reasons; the metrics a scraper reads.
Allocator invariants are checked after each (``checked_harnesses``)."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import (
    DECODE_CONN,
    PREFILL_ADDR,
    ROUTER,
    PDHarness,
    checked_harnesses,
)
from decode_worker.jobs import DecodeState
from decode_worker.local_prefill import (
    RETRACT_COOLDOWN_STEPS,
    LocalPrefillInputs,
    LocalPrefillPolicy,
    LocalPrefillReason,
)
from tests.e2e.test_swa_pd import cfg as swa_cfg
from tests.support.metrics_scrape import scrape, val
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from tests.support.swa import hf_reference, swa_prompts
from transfer.wire.outbox import Conn
from transfer.wire.protocol import (
    GenerateRequest,
    PrefilledLocally,
    PrefillRequest,
    PrefillWithdrawn,
    ids_frame,
)
from transfer.wire.sampling_params import SamplingParams

R = LocalPrefillReason


def lp_cfg(local=64, backlog=0.0, **kw):
    """The size bound alone (``local``; 0 = off) unless ``backlog`` sets the backlog ratio (the
    launch default is 1.0: see ``test_backlogged_prefill_worker_gives_a_long_prompt_...``)."""
    c = pd_cfg(**kw)
    c.cluster.local_prefill_max_tokens = local
    c.cluster.local_prefill_backlog_ratio = backlog
    return c


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda p=None, d=None: PDHarness(p or pd_cfg(), d or lp_cfg(), tiny[0], tiny[1]))


def run(h: PDHarness, ps, params=GREEDY, tag="r") -> list[list[int]]:
    for i, p in enumerate(ps):
        h.submit(f"{tag}{i}", p, params)
    out = h.run()
    assert all(out[f"{tag}{i}"]["error"] is None for i in range(len(ps))), out
    return [out[f"{tag}{i}"]["tokens"] for i in range(len(ps))]


# ---- the decision (pure) ------------------------------------------------------------------------
def inputs(**kw) -> LocalPrefillInputs:
    base = {
        "prompt_tokens": 40,
        "cached_tokens": 0,
        "backlog_tokens": 0,
        "retracted_queue": 0,
        "steps_since_retract": None,
        "prealloc_queue": 0,
        "need_pages": 10,
        "headroom_pages": 100,
    }
    return LocalPrefillInputs(**{**base, **kw})


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw, reason",
    [
        ({}, R.TAKEN),
        ({"prompt_tokens": 65}, R.TOO_LONG),
        ({"prompt_tokens": 200, "cached_tokens": 160}, R.TAKEN),  # only the uncached suffix counts
        ({"backlog_tokens": 30}, R.BUSY),
        ({"retracted_queue": 1}, R.RETRACT_PRESSURE),
        ({"steps_since_retract": RETRACT_COOLDOWN_STEPS - 1}, R.RETRACT_PRESSURE),
        ({"steps_since_retract": RETRACT_COOLDOWN_STEPS}, R.TAKEN),
        ({"prealloc_queue": 1}, R.NO_HEADROOM),
        ({"need_pages": 101}, R.NO_HEADROOM),
        ({"retracted_queue": 1, "prompt_tokens": 500}, R.RETRACT_PRESSURE),  # pressure is checked first
    ],
)
def test_decision(kw, reason):
    d = LocalPrefillPolicy(64).decide(inputs(**kw))
    assert d.reason is reason and d.local == (reason is R.TAKEN)
    assert d.suffix_tokens == inputs(**kw).suffix_tokens
    assert not LocalPrefillPolicy(0).enabled


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"prompt_tokens": 500, "remote_backlog_tokens": 500}, R.TAKEN_BACKLOG),  # its queue finishes first
        ({"prompt_tokens": 500, "remote_backlog_tokens": 499}, R.TOO_LONG),
        ({"prompt_tokens": 500, "backlog_tokens": 100, "remote_backlog_tokens": 550}, R.TOO_LONG),  # < 600
        ({"prompt_tokens": 500, "remote_backlog_tokens": 500, "need_pages": 101}, R.NO_HEADROOM),
        ({"prompt_tokens": 500, "remote_backlog_tokens": 500, "prealloc_queue": 1}, R.NO_HEADROOM),
        ({"prompt_tokens": 500, "remote_backlog_tokens": 5000, "retracted_queue": 1}, R.RETRACT_PRESSURE),
        ({"remote_backlog_tokens": 5000, "backlog_tokens": 30}, R.BUSY),  # short: the size bound's rules
        # each decode row the chunks would stall counts the suffix once more: 500 * (1 + 2)
        ({"prompt_tokens": 500, "remote_backlog_tokens": 1500, "decode_rows": 2}, R.TAKEN_BACKLOG),
        ({"prompt_tokens": 500, "remote_backlog_tokens": 1499, "decode_rows": 2}, R.TOO_LONG),
        ({"prompt_tokens": 500, "backlog_tokens": 100, "remote_backlog_tokens": 1599, "decode_rows": 2}, R.TOO_LONG),
        ({"prompt_tokens": 200, "remote_backlog_tokens": 1400, "decode_rows": 8}, R.TOO_LONG),  # a chat batch
    ],
)
def test_decision_with_a_backlog_ratio(kw, reason):
    d = LocalPrefillPolicy(64, backlog_ratio=1.0).decide(inputs(**kw))
    assert d.reason is reason and d.local == (reason is R.TAKEN_BACKLOG)
    off = LocalPrefillPolicy(64).decide(inputs(**kw))  # no ratio: the size bound alone
    assert off.reason is not R.TAKEN_BACKLOG
    assert LocalPrefillPolicy(0, backlog_ratio=2.0).enabled
    assert LocalPrefillPolicy(0, backlog_ratio=2.0).decide(inputs(remote_backlog_tokens=160)).reason is R.TAKEN_BACKLOG
    assert LocalPrefillPolicy(0, backlog_ratio=2.0).decide(inputs(remote_backlog_tokens=79)).reason is R.TOO_LONG


# ---- the path, against transformers ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("local", [0, 64])
def test_outputs_equal_transformers_off_and_on(harness, pd_refs, local):
    h = harness(d=lp_cfg(local))
    ps, ref = pd_refs
    assert run(h, ps) == ref
    taken = h.decode.local.decisions[R.TAKEN]
    if local:
        suffixes = sum(len(p) for p in ps)  # the tree is cold and the prompts share no page
        refused = h.decode.local.decisions[R.BUSY] + h.decode.local.decisions[R.NO_HEADROOM]  # a burst: shared
        assert taken + refused == 6 and taken >= 1
        assert h.prefill.withdrawn == taken and h.prefill.stats.finished_requests == 6 - taken
        assert h.decode.local.tokens <= suffixes
    else:
        assert taken == 0 and h.decode.local.tokens == 0 and h.prefill.withdrawn == 0
        assert sum(h.decode.local.decisions.values()) == 0  # off: no decision is taken or counted


@pytest.mark.slow
def test_withdrawal_before_the_prefill_request(harness, tiny):
    """The decode worker's ``PrefillWithdrawn`` overtakes the router's ``PrefillRequest``: the
    latter is dropped on arrival, without an answer to the router."""
    h = harness()
    p = pd_prompts(1, 20, 20, seed=8)[0]
    h.deliver(
        h.decode.add(ROUTER, GenerateRequest(rid="w", params=GREEDY, room=77, prefill_addr=PREFILL_ADDR), p), True
    )
    h._exchange()  # the withdrawal reaches the prefill worker first
    req = PrefillRequest(rid="w", room=77, params=GREEDY, decode_worker="d0")
    assert h.prefill.handle(Conn(ROUTER), req, [ids_frame(p)]).messages == []
    assert not h.prefill.jobs and not h.prefill.bootstrapping
    out = h.run()
    assert out["w"]["tokens"] == hf_greedy(tiny[2], p, 16) and not h.router_inbox


@pytest.mark.slow
def test_second_turn_prefix_cached_on_decode_is_prefilled_locally(harness, tiny):
    h = harness(d=lp_cfg(12))
    turn1 = pd_prompts(1, 40, 40, seed=5)[0]
    assert run(h, [turn1], tag="a") == [hf_greedy(tiny[2], turn1, 16)]
    assert h.decode.local.decisions[R.TOO_LONG] == 1 and h.prefill.transfer_bytes > 0
    shipped = h.prefill.transfer_bytes
    first = h.decode.stats.cached_prompt_tokens
    turn2 = turn1 + hf_greedy(tiny[2], turn1, 16)[:8] + [3, 4]  # 58 tokens, 40 of them cached (page 4)
    assert run(h, [turn2], tag="b") == [hf_greedy(tiny[2], turn2, 16)]
    assert h.decode.local.decisions[R.TAKEN] == 1 and h.prefill.transfer_bytes == shipped
    assert h.decode.stats.cached_prompt_tokens - first == 48  # turn 1's prompt + 8 of its outputs, page aligned
    assert h.decode.local.tokens == len(turn2) - 48


@pytest.mark.slow
def test_prompt_logprobs_and_stop_on_the_first_token(harness, tiny):
    """The first token is sampled locally with the request's own stop handling, and prompt
    logprobs travel with it as the prefill worker would send them."""
    p = pd_prompts(1, 12, 12, seed=9)[0]
    first = hf_greedy(tiny[2], p, 1)[0]
    outs = []
    for local in (0, 64):
        h = harness(d=lp_cfg(local))
        h.submit("s", p, SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[first]))
        h.submit("l", p, SamplingParams(max_new_tokens=4, temperature=0, prompt_logprobs=2))
        outs.append(h.run())
    off, on = outs
    assert on["s"]["tokens"] == off["s"]["tokens"] == [] and on["s"]["finish"] == "stop"
    assert on["l"]["tokens"] == off["l"]["tokens"] == hf_greedy(tiny[2], p, 4)
    lp_on, lp_off = on["l"]["prompt_logprobs"], off["l"]["prompt_logprobs"]
    assert len(lp_on) == len(lp_off) == len(p)
    for a, b in zip(lp_on, lp_off):
        assert (a is None) == (b is None)
        if a is not None:  # (logprob, top [(token, logprob)], rank)
            assert a[0] == pytest.approx(b[0], abs=1e-4) and a[2] == b[2]
            assert [t for t, _ in a[1]] == [t for t, _ in b[1]]


@pytest.mark.slow
@pytest.mark.parametrize("host_gb", [0.01, 0.0])
def test_forced_retract_of_local_requests(harness, pd_refs, host_gb):
    """Retract every 3 decode steps: locally prefilled requests are offloaded and resumed (host
    pool) or recomputed by the prefill worker (no host pool), and still match transformers. The
    cooldown is off so requests keep being taken between retracts."""
    h = harness(d=lp_cfg(64, host_gb=host_gb, retract_test_interval=3))
    h.decode.local.policy = LocalPrefillPolicy(64, retract_cooldown_steps=0)
    ps, ref = pd_refs
    assert run(h, ps) == ref
    rs = h.decode.retract.stats
    assert h.decode.local.decisions[R.TAKEN] >= 1 and h.decode.stats.retractions > 0
    assert rs.resumed > 0 if host_gb else rs.recomputed > 0


@pytest.mark.slow
def test_retract_pressure_sends_to_prefill(harness, tiny):
    h = harness(d=lp_cfg(64, retract_test_interval=2))
    ps = pd_prompts(3, 10, 10, seed=12)
    assert run(h, ps[:2], tag="a") == [hf_greedy(tiny[2], p, 16) for p in ps[:2]]
    assert h.decode.stats.retractions > 0 and h.decode.local.decisions[R.TAKEN] == 2
    assert run(h, ps[2:], tag="b") == [hf_greedy(tiny[2], ps[2], 16)]  # within the cooldown of those retracts
    assert h.decode.local.decisions[R.RETRACT_PRESSURE] == 1 and h.prefill.stats.finished_requests == 1


@pytest.mark.slow
def test_abort_during_local_prefill_frees_everything(harness):
    h = harness(d=lp_cfg(64, chunked_prefill_size=8))
    p = pd_prompts(1, 30, 30, seed=2)[0]
    h.submit("x", p, GREEDY)
    h.step()
    h.step()
    job = h.decode.jobs["x"]
    assert job.state is DecodeState.LOCAL_PREFILL and 0 < job.req.kv_len < len(p)  # chunked: part computed
    out = h.decode.abort("x")
    assert out.deltas[0].finish_reason == "abort" and "x" not in h.decode.jobs
    assert not h.decode.local and h.decode.local.chunked is None
    h.run()


@pytest.mark.slow
def test_metrics_move_by_the_decisions(harness, tiny):
    """``pdserve_local_prefill_total{reason}`` and ``pdserve_local_prefill_tokens_total`` as a
    scraper of the router reads them: two short prompts taken (the second one after the first
    finished), one too long. The router hears ``PrefilledLocally`` for the taken ones only."""
    h = harness(d=lp_cfg(20))
    short, long_ = pd_prompts(2, 14, 14, seed=31), pd_prompts(1, 25, 25, seed=32)[0]
    run(h, short[:1], tag="a")
    run(h, short[1:], tag="b")
    run(h, [long_], tag="c")
    m = scrape(h.decode)
    assert val(m, "pdserve_local_prefill_total", reason="taken") == 2
    assert val(m, "pdserve_local_prefill_total", reason="too_long") == 1
    assert val(m, "pdserve_local_prefill_total", reason="busy") == 0
    assert val(m, "pdserve_local_prefill_tokens_total") == 28
    assert val(m, "pdserve_request_phase_seconds_count", phase="local_prefill") == 2
    assert val(m, "pdserve_request_phase_seconds_count", phase="kv_wait") == 1
    assert h.router_messages == [PrefilledLocally(rid="a0"), PrefilledLocally(rid="b0")]


def test_withdrawn_prefill_request_is_gone_from_the_bootstrap_queue(harness):
    """Prefill side alone: a ``PrefillWithdrawn`` for a request in bootstrap removes it silently."""
    h = harness()
    p = pd_prompts(1, 10, 10, seed=1)[0]
    req = PrefillRequest(rid="q", room=5, params=GREEDY, decode_worker="d0")
    h.prefill.handle(Conn(ROUTER), req, [ids_frame(p)])
    assert h.prefill.jobs
    out = h.prefill.handle(Conn(DECODE_CONN), PrefillWithdrawn(rid="q", room=5), [])
    assert out.messages == [] and out.deltas == [] and not h.prefill.jobs and h.prefill.withdrawn == 1


# ---- sliding-window hybrid (SWA pools) ------------------------------------------------------------
@pytest.fixture
def swa_harness(swa_model):
    def build(**d):
        dc = swa_cfg(**d)
        dc.cluster.local_prefill_max_tokens = 32
        return PDHarness(swa_cfg(), dc, swa_model[0], swa_model[1], eos=(96,))

    yield from checked_harnesses(build)


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True])
def test_swa_second_turn_local_then_forced_retract(swa_harness, swa_model, mixed):
    """SWA pools, decode radix on: turn 1 (40 tokens, too long) goes to the prefill worker, turn 2's new
    tokens are prefilled by the decode worker over its cached prefix, in separate or mixed
    forwards, with a retract forced every 3 decode steps; outputs equal transformers."""
    h = swa_harness(retract_test_interval=3, mixed_batches=mixed)
    params = SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)
    turn1 = swa_prompts(1, 40)[0]
    h.submit("a", turn1, params)
    out1 = h.run()["a"]["tokens"]
    assert out1 == hf_reference(swa_model[2], turn1, 9)[0]
    turn2 = turn1 + out1 + swa_prompts(1, 6)[0]
    h.decode.local.policy = LocalPrefillPolicy(32, retract_cooldown_steps=0)  # retracts are forced here
    h.submit("b", turn2, params)
    early = []
    while h.decode.jobs["b"].state is not DecodeState.RUNNING:  # c arrives while b decodes: mixed steps
        early += [t for d in h.step() for t in d.token_ids]
    h.submit("c", swa_prompts(2, 12)[1], params)
    out = h.run()
    out["b"]["tokens"] = early + out["b"]["tokens"]
    assert out["b"]["tokens"] == hf_reference(swa_model[2], turn2, 9)[0]
    assert out["c"]["tokens"] == hf_reference(swa_model[2], swa_prompts(2, 12)[1], 9)[0]
    d = h.decode.local.decisions
    assert d[R.TOO_LONG] == 1 and d[R.TAKEN] == 2 and h.decode.stats.retractions > 0, str(d)
    assert h.decode.stats.mixed_steps > 0 if mixed else h.decode.stats.mixed_steps == 0


@pytest.mark.slow
def test_backlogged_prefill_worker_gives_a_long_prompt_to_the_decode_worker(harness, tiny):
    """The launch defaults (``--local-prefill-backlog-ratio 1``, the size bound off): the first
    long prompt goes to the prefill worker; the second arrives while the first is reserved but not
    written yet (30 tokens of remote backlog against its own 30, no decode rows) and is prefilled
    by the decode worker. Both equal transformers; the counter and the withdrawal say which went
    where."""
    d = pd_cfg()
    assert (d.cluster.local_prefill_backlog_ratio, d.cluster.local_prefill_max_tokens) == (1.0, 0)
    h = harness(d=d)
    a, b = pd_prompts(2, 30, 30, seed=41)
    h.submit("a", a, GREEDY)
    for _ in range(20):  # until a's pages are reserved (its prefill worker has not written yet)
        h.router_inbox += h.step()
        if any(j.req.rid == "a" for j in h.decode.transfers.inflight.values()):
            break
    assert h.decode.transfers.backlog_tokens() == 30
    h.submit("b", b, GREEDY)
    out = h.run()
    got = {
        rid: [t for dl in h.router_inbox if dl.rid == rid for t in dl.token_ids] + out.get(rid, {}).get("tokens", [])
        for rid in ("a", "b")
    }
    assert got == {"a": hf_greedy(tiny[2], a, 16), "b": hf_greedy(tiny[2], b, 16)}
    dec = h.decode.local.decisions
    assert (dec[R.TOO_LONG], dec[R.TAKEN_BACKLOG], dec[R.TAKEN]) == (1, 1, 0)
    assert h.prefill.withdrawn == 1 and h.prefill.stats.finished_requests == 1 and h.decode.local.tokens == 30
    m = scrape(h.decode)
    assert val(m, "pdserve_local_prefill_total", reason="taken_backlog") == 1
    assert val(m, "pdserve_local_prefill_total", reason="too_long") == 1
    assert h.decode.transfers.backlog_tokens() == 0


@pytest.mark.slow
def test_a_decoding_batch_keeps_long_prompts_on_the_prefill_worker(harness, tiny):
    """The rows term: with one request decoding, a prompt is taken only when the remote backlog is
    at least twice its suffix (it would stall that row), so the same 30 tokens of remote backlog
    that hand an idle decode worker a 30-token prompt (test above) now leave it to the prefill
    worker. Outputs equal transformers."""
    h = harness(d=pd_cfg())
    a, b, c = pd_prompts(3, 30, 30, seed=43)
    h.submit("a", a, SamplingParams(max_new_tokens=24, temperature=0))

    def until(cond):
        for _ in range(40):
            if cond():
                return
            h.router_inbox += h.step()
        raise AssertionError("the harness did not get there")

    until(lambda: any(r.rid == "a" for r in h.decode.running.reqs))  # a decodes: one row
    h.submit("b", b, GREEDY)
    until(lambda: h.decode.transfers.backlog_tokens() == 30)  # b reserved, not written
    h.submit("c", c, GREEDY)
    dec = h.decode.local.decisions
    assert (dec[R.TOO_LONG], dec[R.TAKEN_BACKLOG]) == (3, 0), dec  # 30 < 1 * (30 * (1 + 1))
    out = h.run()
    got = {
        rid: [t for dl in h.router_inbox if dl.rid == rid for t in dl.token_ids] + out.get(rid, {}).get("tokens", [])
        for rid in ("a", "b", "c")
    }
    assert got == {"a": hf_greedy(tiny[2], a, 24), "b": hf_greedy(tiny[2], b, 16), "c": hf_greedy(tiny[2], c, 16)}
    assert h.prefill.withdrawn == 0 and h.prefill.stats.finished_requests == 3 and h.decode.local.tokens == 0


@pytest.mark.slow
def test_mixed_step_with_nothing_to_run_is_no_forward(harness, tiny):
    """A decode worker with ``--mixed-batches`` whose local request cannot be admitted this step
    (no pages yet) while nothing runs: the step runs no forward (it crashed the worker with an
    empty batch once), and the request is prefilled in a later step."""
    d = lp_cfg(64)
    d.scheduler.mixed_batches = True
    h = harness(d=d)
    p = pd_prompts(1, 20, 20, seed=51)[0]
    h.submit("a", p, GREEDY)
    assert h.decode.local.waiting and not h.decode.running
    select, calls = h.decode.local.select, []
    h.decode.local.select = lambda *a, **k: calls.append(1) or []  # admission refuses once
    h.decode.step()
    assert calls and h.decode.local.waiting and h.decode.stats.extend_steps == 0
    h.decode.local.select = select
    assert h.run()["a"]["tokens"] == hf_greedy(tiny[2], p, 16)
    assert h.decode.local.decisions[R.TAKEN] == 1
