"""Migration of retracted requests between decode workers, in one process: the
decision and its bounds, the source's state machine, the router's re-pointing, the KV written
from the host pool with the prefill path's manifest, and the faults (target gone, refusal,
abort mid-migration); greedy tokens equal transformers and every pool is clean afterwards."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.pd_harness import checked_harnesses
from configs.schema import PdserveConfig, migrate_bound
from decode_worker.jobs import DecodeJob, DecodeState, IllegalTransition
from decode_worker.migration import MigrationPolicy
from decode_worker.migration_steps import admit_migrated
from engine.request import Request
from engine.sampling import SamplerState
from server.router.inflight import InflightTable
from server.router.metrics import WorkerCollector
from server.router.migration import Migrations, pick_target
from server.router.registry import Registry
from server.router.workers import READY, WorkerHandle, WorkerSpec, route_pd
from server.worker.loop import worker_stats
from tests.support.migration_harness import MigrationHarness
from tests.support.models import hf_greedy
from transfer.wire.enums import Role
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import MigrateRequest, MigrationEnded, MigrationOffer, TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams, StructuredOutput

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def cfg(pool=4096, page=4, host_gb=0.01, migrate_after=None, **sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": page},
            "scheduler": sched,
            "cluster": {
                "mode": "pd",
                "host_kv_pool_gb": host_gb,
                "transfer_backend": "loopback",
                "migrate_after": migrate_after,
            },
        }
    )


def prompts(n, lo, hi, seed):
    rng = random.Random(seed)
    return [[rng.randrange(0, 96) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- decision --------------------------------------------------------------------------------------
def test_migrate_after_flag_forms():
    assert migrate_bound("20") == (20, None) and migrate_bound("2.5s") == (None, 2.5)
    for bad in ("x", "-1", "s", "1.5"):
        with pytest.raises(ValueError, match="decode steps"):
            migrate_bound(bad)
    with pytest.raises(ValueError, match="migrate_after"):
        cfg(migrate_after="soon")


def _job(parked_step=0, parked_at=0.0):
    req = Request("r", [1, 2, 3], GREEDY, SamplerState.new(GREEDY, 8))
    job = DecodeJob(req, 1, "a", state=DecodeState.HOST_PARKED)
    job.parked_step, job.parked_at = parked_step, parked_at
    return job


def test_policy_due_by_steps_or_seconds():
    steps = MigrationPolicy.from_flag("3")
    assert not steps.due(_job(parked_step=10), 12, 0.0) and steps.due(_job(parked_step=10), 13, 0.0)
    secs = MigrationPolicy.from_flag("0.5s")
    now = time.monotonic()
    assert not secs.due(_job(parked_at=now - 0.2), 0, now) and secs.due(_job(parked_at=now - 0.6), 0, now)


def test_migrating_edges():
    job = _job()
    job.enter(DecodeState.MIGRATING)
    assert job.req.status == "retracted"
    with pytest.raises(IllegalTransition):
        job.enter(DecodeState.RUNNING)  # a migrating job resumes only through HOST_PARKED
    job.enter(DecodeState.HOST_PARKED)
    assert job.parked_step == -1  # re-stamped by the policy's next step
    job.enter(DecodeState.MIGRATING)
    job.enter(DecodeState.FINISHED)


def _handle(wid, room, page_size=4, model="m", state=READY, role=Role.DECODE):
    stats = WorkerStats(
        worker_id=wid,
        role=role,
        model=model,
        capacity_tokens=100,
        max_model_len=100,
        page_size=page_size,
        gauges={"migration_room_pages": room},
    )
    return WorkerHandle(WorkerSpec(wid, role, f"inproc://{wid}"), None, state=state, stats=stats)


def test_pick_target_needs_room_model_and_page_size():
    src = _handle("d1", 0)
    peers = [
        _handle("d2", 10),
        _handle("d3", 50),
        _handle("d4", 99, page_size=16),
        _handle("d5", 99, model="x"),
        _handle("d6", 99, state="dead"),
        _handle("p0", 99, role=Role.PREFILL),
    ]
    assert pick_target([src, *peers], src, 8).worker_id == "d3"  # the most room among the compatible
    assert pick_target([src, *peers], src, 51) is None  # no compatible peer reports that much room
    assert pick_target([src], src, 1) is None  # never itself


class _Client:
    def __init__(self):
        self.sent = []

    def migrate(self, rid, *a, **kw):
        self.sent.append(("migrate", rid))

    def decline_migration(self, rid, why):
        self.sent.append(("declined", rid))


def test_offers_between_reports_share_the_reported_room():
    """A report is up to a heartbeat old: offers granted since it count against its room, and a
    new report starts afresh (a burst of offers once all went to one peer and overfilled it)."""
    src, dst = _handle("d1", 0), _handle("d2", 50)
    src.client, dst.client = _Client(), _Client()
    table = InflightTable()
    moves = Migrations({"d1": src, "d2": dst}, table, iter(range(100)).__next__)
    params = SamplingParams(max_new_tokens=8)
    for rid in ("a", "b", "c"):
        table.open(rid, ("p0", "d1"), "d1", 10)

    def offer(rid):
        return moves.on_offer(
            "d1", MigrationOffer(rid=rid, n_tokens=40, pages=30, prompt_len=8, params=params), [1] * 40
        )

    offer("a")
    offer("b")  # 50 - 30 left: declined
    assert dst.client.sent == [("migrate", "a")] and src.client.sent == [("declined", "b")]
    dst.stats = dst.stats.model_copy()  # the next report (its own view of the room: 50 again)
    offer("c")
    assert dst.client.sent == [("migrate", "a"), ("migrate", "c")]
    assert moves.granted_since_report(dst) == 30


def test_repoint_keeps_source_dependency_until_the_target_streams():
    t = InflightTable()
    e = t.open("r", ("p0", "d1"), "d1", 10)
    e.depends_on = ("d1",)
    t.repoint("r", "d2")
    assert e.stream_from == "d2" and e.workers == ("p0", "d1", "d2") and e.depends_on == ("d1",)
    assert not t.dispatch("d1", TokenDelta(rid="r", token_ids=[5]))  # the old stream is off
    assert t.fail_worker("d2", 503, "gone") == []  # the target's death alone does not fail it yet
    assert t.dispatch("d2", TokenDelta(rid="r", token_ids=[7]))
    assert e.depends_on == ("d2",)
    t.leave("r", "d1")
    assert e.workers == ("p0", "d2")


class _RegClient(_Client):
    def __init__(self, spec, on_tokens, on_stats):
        super().__init__()

    def abort(self, rids, reason):
        self.sent += [("abort", r) for r in rids]


def _moving(target_room=50):
    """A registry whose d1 offered ``r`` (streamed from d1 so far) and the router sent it to d2."""
    specs = [WorkerSpec(w, Role.DECODE, f"inproc://{w}") for w in ("d1", "d2")]
    reg = Registry(specs, _RegClient, InflightTable(), policy=route_pd)
    for wid, room in (("d1", 0), ("d2", target_room)):
        h = reg.handles[wid]
        h.state, h.stats = READY, _handle(wid, room).stats
    e = reg.table.open("r", ("p0", "d1"), "d1", 10)
    reg.table.dispatch("d1", TokenDelta(rid="r", token_ids=[3]))
    reg.migrations.on_offer(
        "d1",
        MigrationOffer(rid="r", n_tokens=40, pages=30, prompt_len=8, params=SamplingParams(max_new_tokens=8)),
        [1] * 40,
    )
    assert reg.handles["d2"].client.sent == [("migrate", "r")] and e.stream_from == "d2"
    e.queue.get_nowait()
    return reg, e


@pytest.mark.parametrize("write_ok", [False, True])
def test_target_lost_before_the_source_reports(write_ok):
    """The router gives the target up (no heartbeat) while the source's write may be under way:
    the migration is undone (the source is told, the target aborted) and the stream is the
    source's again; a write that failed leaves the request to the source, one that finished anyway
    (the source forgot it) fails it explicitly instead of leaving the client waiting forever."""
    reg, e = _moving()
    assert reg.mark_dead("d2", "no heartbeat") == []  # it had not streamed from d2: not failed with it
    assert e.stream_from == "d1" and "d2" not in e.workers and "r" not in reg.migrations.moving
    assert reg.handles["d1"].client.sent == [("declined", "r")] and ("abort", "r") in reg.handles["d2"].client.sent
    reg.migrations.on_ended("d2", MigrationEnded(rid="r", ok=True))  # not the source: ignored
    assert e.queue.empty()
    reg.migrations.on_ended("d1", MigrationEnded(rid="r", ok=write_ok, error=None if write_ok else "peer gone"))
    if write_ok:
        delta = e.queue.get_nowait()
        assert delta.error_status == 503 and "which was lost before it could stream" in delta.error
    else:
        assert e.queue.empty() and reg.table.dispatch("d1", TokenDelta(rid="r", token_ids=[4]))
    assert reg.migrations.abandoned == {}


def test_target_lost_after_it_streamed_fails_the_request_only_once():
    reg, e = _moving()
    assert reg.table.dispatch("d2", TokenDelta(rid="r", token_ids=[4]))  # d2 streams before d1's ok came
    e.queue.get_nowait()
    assert reg.mark_dead("d2", "no heartbeat") == ["r"]
    assert e.queue.get_nowait().error_status == 503 and e.queue.empty()
    assert reg.migrations.moving == {} and reg.migrations.abandoned == {}
    assert ("declined", "r") not in reg.handles["d1"].client.sent


def test_source_lost_mid_migration_fails_it_and_forgets_the_move():
    reg, e = _moving()
    assert reg.mark_dead("d1", "no heartbeat") == ["r"]
    assert e.queue.get_nowait().error_status == 503
    assert reg.migrations.moving == {} and ("abort", "r") in reg.handles["d2"].client.sent


# ---- the whole path, in process --------------------------------------------------------------------
@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(
        lambda d1=None, d2=None: MigrationHarness(
            cfg(), d1 or cfg(pool=96, migrate_after="1", init_new_token_ratio=0.1), d2 or cfg(), tiny[0], tiny[1]
        )
    )


SKEW = dict(n=4, lo=20, hi=20, seed=21)  # 4 x (20 + 16) tokens into a 24-page pool: d1 must retract


def _run(h, ps):
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    return h.run()


@pytest.mark.slow
def test_retracted_requests_move_and_match_transformers(harness, tiny):
    h = harness()
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    out = _run(h, ps)
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert all(o["error"] is None and o["finish"] == "length" for o in out.values())
    ms1, ms2 = h.d1.migration_stats, h.d2.migration_stats
    assert ms1.out_done > 0 and ms2.in_done == ms1.out_done and ms1.out_failed == ms2.in_refused == 0
    page_bytes = h.d1.retract.host.page_bytes
    assert ms1.out_bytes > 0 and ms1.out_bytes % page_bytes == 0  # whole host rows, straight from the host pool
    moved = [o for o in out.values() if "d2" in o["from"]]
    assert len(moved) == ms1.out_done and all(o["from"][0] == "d1" for o in moved)  # one stream, two sources
    m = scrape(h)  # what a Prometheus scraper of the router reads
    assert m[("pdserve_migrations_total", "d1", "out", "done")] == ms1.out_done
    assert m[("pdserve_migrations_total", "d1", "out", "declined")] == ms1.out_declined
    assert m[("pdserve_migrations_total", "d2", "in", "done")] == ms1.out_done
    assert m[("pdserve_migrations_total", "d2", "in", "refused")] == 0
    assert m[("pdserve_migration_bytes_total", "d1")] == ms1.out_bytes
    assert m[("pdserve_migration_seconds_count", "d1")] == ms1.out_done
    assert m[("pdserve_migration_seconds_count", "d2")] == 0


def scrape(h: MigrationHarness) -> dict[tuple, float]:
    """Samples of the router's ``WorkerCollector`` over the harness's workers, keyed by
    (name, worker[, direction, outcome])."""
    for w, s in h.workers.items():
        h.handles[w].stats, h.handles[w].stats_at = worker_stats(s, w, "i", "m"), 0.0
    reg = CollectorRegistry()
    reg.register(WorkerCollector(lambda: list(h.handles.values()), clock=lambda: 0.0))
    fams = text_string_to_metric_families(generate_latest(reg).decode())
    return {
        (x.name, *(x.labels[k] for k in ("worker", "direction", "outcome") if k in x.labels)): x.value
        for f in fams
        for x in f.samples
        if "migration" in x.name
    }


@pytest.mark.slow
def test_seeded_sampling_and_penalties_survive_the_move(harness):
    """Sampled tokens are seeded per output index and the penalty counts are rebuilt from the
    output so far: a migrated request samples exactly what it would have without pressure."""
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, frequency_penalty=0.5)
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    calm = harness(d1=cfg(migrate_after="1"))
    for i, p in enumerate(ps):
        calm.submit(f"r{i}", p, params, decode="d1")
    ref = calm.run()
    h = harness()
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, params, decode="d1")
    out = h.run()
    assert h.d1.migration_stats.out_done > 0 and calm.d1.stats.retractions == 0
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [ref[f"r{i}"]["tokens"] for i in range(len(ps))]


@pytest.mark.slow
def test_no_peer_room_declines_and_resumes_locally(harness, tiny):
    h = harness(d2=cfg(pool=16))  # 4 pages: never room for a migrated request
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    out = _run(h, ps)
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
    ms = h.d1.migration_stats
    assert ms.out_declined > 0 and ms.out_done == 0 and h.d2.migration_stats.in_done == 0
    assert h.d1.retract.stats.resumed > 0


def test_a_worker_offering_its_own_requests_reports_no_room(harness):
    """While d1 offers parked requests it is under pressure itself: it reports no room for
    migrations in (two full workers would swap their parked requests), and room again after."""
    h = harness()
    for i, p in enumerate(prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    offering_seen = 0
    while h.busy:
        h.step()
        room = worker_stats(h.d1, "d1", "i", "m").gauges["migration_room_pages"]
        if h.d1.migration.offered:
            offering_seen += 1
            assert room == 0
    assert offering_seen > 0
    assert worker_stats(h.d1, "d1", "i", "m").gauges["migration_room_pages"] > 0


@pytest.mark.slow
def test_target_dies_mid_transfer_source_resumes(harness, tiny, monkeypatch):
    h = harness()
    # the target's transport peer vanishes before the write: the loopback write reports an error
    sender_start = h.d1.migration.sender.start

    def start_then_die(job, peer, src, dst, manifest):
        h.dead.add("d2")
        h.handles["d2"].state = "dead"  # the router's heartbeat would notice soon; here at once
        h.d1.migration.sender.transport.remove_peer(h.d1.migration.sender.peers[peer].transport_name)
        return sender_start(job, peer, src, dst, manifest)

    monkeypatch.setattr(h.d1.migration.sender, "start", start_then_die)
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    out = _run(h, ps)
    assert [out[f"r{i}"]["tokens"] for i in range(len(ps))] == [hf_greedy(tiny[2], p, 16) for p in ps]
    assert h.d1.migration_stats.out_failed >= 1 and h.d1.migration_stats.out_done == 0
    assert all(o["error"] is None for o in out.values())


@pytest.mark.slow
def test_abort_while_migrating_frees_everything(harness):
    h = harness()
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    for _ in range(500):
        h.step()
        if h.d1.migration.offered:
            break
    rid = next(iter(h.d1.migration.offered))
    for w in h.table.workers_of(rid):
        h.handles[w].client.abort([rid], "client gone")
    h.table.close(rid)
    h.run()
    assert rid not in h.d1.jobs and rid not in h.d2.jobs


@pytest.mark.slow
def test_source_dies_mid_migration_fails_explicitly_and_target_frees(harness):
    """d1 dies after the router sent the request to d2: the router fails it with 503 (what
    ``Registry.mark_dead`` does) and aborts it on d2, whose reserved pages stay fenced until
    ``transfer_fence_s`` (a late write may still land) and are then freed."""
    d2 = cfg()
    d2.cluster.peer_timeout_s, d2.cluster.progress_timeout_s, d2.cluster.transfer_fence_s = 0.5, 5.0, 0.5
    h = harness(d2=d2)
    real = h.d1.migration.destination
    h.d1.migration.destination = lambda *a, **k: Outbox()  # d1 takes the destination, then dies before writing
    ps = prompts(SKEW["n"], SKEW["lo"], SKEW["hi"], SKEW["seed"])
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    for _ in range(2000):
        h.step()
        if any(j.migrated and j.state is DecodeState.AWAITING_KV for j in h.d2.jobs.values()):
            break
    moved = [r for r, j in h.d2.jobs.items() if j.migrated]
    h.d1.migration.destination = real
    h.dead.add("d1")
    h.handles["d1"].state = "dead"
    workers = {r: h.table.workers_of(r) for r in h.table.rids()}
    for r in h.table.fail_worker("d1", 503, "worker d1 is unavailable"):
        for w in workers[r]:
            if w != "d1":
                h.handles[w].client.abort([r], "router gave up on the request")
    deadline = time.monotonic() + 30
    while h.busy and time.monotonic() < deadline:
        h.step()
        time.sleep(0.01)
    assert moved and all(h.out[r]["finish"] == "abort" and "d1" in h.out[r]["error"] for r in moved)
    assert not h.d2.jobs and h.d2.migration_stats.in_failed == len(moved) and h.d2.migration_stats.in_done == 0


def test_a_structured_request_keeps_its_grammar_on_the_target(harness, monkeypatch):
    """The target builds a migrated request's sampler state as the runner builds any request's:
    with the grammar matcher of a structured-output request, which then consumes the output so far,
    so the constraint holds for the rest of the stream (a seeded ``json_schema`` request moved by a
    role switch decoded unconstrained before)."""
    h = harness()
    consumed = []

    class Matcher:
        def consume(self, token_id: int) -> None:
            consumed.append(token_id)

    monkeypatch.setattr(h.d2.runner, "grammar", SimpleNamespace(matcher=lambda spec: Matcher()))
    params = SamplingParams(max_new_tokens=16, temperature=0, structured=StructuredOutput(kind="json", spec="{}"))
    msg = MigrateRequest(rid="m0", params=params, room=1, source_addr="tcp://127.0.0.1:1", prompt_len=4, n_tokens=5)
    admit_migrated(h.d2, b"router", msg, [5, 6, 7, 8, 9, 10])
    state = h.d2.jobs["m0"].req.sampler_state
    assert isinstance(state.matcher, Matcher) and consumed == [9, 10] and state.num_generated == 2
    h.d2.abort("m0")
