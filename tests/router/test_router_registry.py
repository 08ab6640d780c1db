"""Router units without HTTP: the worker registry (liveness, model check, PD routing and request
fan-out), the launcher's startup failure and config checks, a PD session's abort of the other side.
(The HTTP layer against a fake worker: tests/router/test_router_unit.py.)"""

from __future__ import annotations

import asyncio
import io
import sys

import pytest

from configs.schema import PdserveConfig
from server.router.inflight import InflightTable
from server.router.registry import DEAD, READY, ROUTING_POLICIES, Registry, WorkerSpec
from transfer.wire.protocol import TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams


def test_registry_marks_silent_worker_dead_and_fails_requests():
    now = [0.0]

    class Client:
        aborted: list = []

        def abort(self, rids, reason):
            self.aborted += rids

    table = InflightTable()
    reg = Registry(
        [WorkerSpec("w0", "colocated", "x")], lambda *a: Client(), table, timeout_s=2.0, clock=lambda: now[0]
    )
    assert reg.health() == (False, "w0 (colocated): starting: waiting for its first heartbeat")
    reg.on_stats(
        "w0",
        WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10, max_model_len=10, page_size=1),
    )
    assert reg.health()[0] and reg.route().stream_from.worker_id == "w0"

    async def scenario():
        entry = table.open("r1", ("w0",), "w0", 5)
        now[0] = 2.5
        reg.check_liveness()
        return entry.queue.get_nowait()

    err = asyncio.run(scenario())
    assert (err.error_status, err.token_ids) == (503, []) and "no heartbeat for 2.5s" in err.error
    assert reg.handles["w0"].state == DEAD and reg.handles["w0"].client.aborted == ["r1"]
    reg.on_stats(
        "w0",
        WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10, max_model_len=10, page_size=1),
    )
    assert reg.handles["w0"].state == READY
    reg.mark_dead("w0", "worker process exited with code 1", permanent=True)
    reg.on_stats(
        "w0",
        WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10, max_model_len=10, page_size=1),
    )
    assert reg.handles["w0"].state == DEAD


@pytest.mark.process  # the launcher starts a (failing) worker process
def test_launch_fails_when_worker_dies_at_startup(capsys):
    from bench.harness.subprocess_server import free_base_port
    from server.launch.launcher import Launcher

    cfg = PdserveConfig.model_validate(
        {"server": {"port": 0}, "cluster": {"mode": "colocated", "base_port": free_base_port(1)}}
    )
    die = [sys.executable, "-c", "import sys; print('worker: no such model', file=sys.stderr); sys.exit(3)"]
    out = io.StringIO()
    rc = asyncio.run(Launcher(cfg, argv=lambda spec, c: die, out=out, install_signals=False).run())
    assert rc == 1 and out.getvalue() == ""
    assert "worker colocated-0 (colocated) exited with code 3 during startup" in capsys.readouterr().err


def test_pd_worker_specs_and_routing():
    from server.launch.launcher import worker_specs
    from server.router.registry import Route, WorkerHandle, route_pd, send_request

    specs = worker_specs(
        PdserveConfig.model_validate({"cluster": {"mode": "pd", "prefill": 2, "decode": 1, "base_port": 30000}})
    )
    assert [(s.worker_id, s.role, s.addr) for s in specs] == [
        ("prefill-0", "prefill", "tcp://127.0.0.1:30000"),
        ("prefill-1", "prefill", "tcp://127.0.0.1:30001"),
        ("decode-0", "decode", "tcp://127.0.0.1:30002"),
    ]

    class Rec:
        def __init__(self):
            self.calls = []

        def generate(self, *a, **kw):
            self.calls.append(("generate", a, kw))

        def prefill(self, *a, **kw):
            self.calls.append(("prefill", a, kw))

    handles = [WorkerHandle(s, Rec()) for s in specs]
    load = {"prefill-0": 50, "prefill-1": 10, "decode-0": 0}
    route = route_pd(handles, load.__getitem__)
    assert [h.worker_id for h in route.targets] == ["prefill-1", "decode-0"] and route.stream_from is handles[2]
    params = SamplingParams(max_new_tokens=3)
    send_request(route, "r1", 77, [1, 2, 3], params)
    assert handles[1].client.calls == [("prefill", ("r1", 77, [1, 2, 3], params, "decode-0"), {})]
    assert handles[2].client.calls == [
        ("generate", ("r1", [1, 2, 3], params), {"room": 77, "prefill_addr": "tcp://127.0.0.1:30001", "preempt": False})
    ]
    send_request(route, "r2", 78, [1], params, preempt=True)  # the admission grant's mark reaches decode only
    assert handles[1].client.calls[-1] == ("prefill", ("r2", 78, [1], params, "decode-0"), {})
    assert handles[2].client.calls[-1][2]["preempt"] is True
    assert isinstance(route, Route)


def test_launch_refuses_unknown_config_keys(tmp_path, capsys):
    from server.launch.cli import main

    preset = tmp_path / "bad.yaml"
    preset.write_text("server:\n  port: 8001\n  colour: blue\n")
    assert main(["launch", "--config", str(preset)]) == 2
    assert "colour" in capsys.readouterr().err


def test_small_preset_loads_and_flags_win():
    from bench.harness.subprocess_server import REPO_ROOT
    from configs.schema import load_config

    cfg = load_config(
        REPO_ROOT / "configs/presets/colocated-small.yaml", {"port": 8123}, environ={"PDSERVE_API_KEY": "k"}
    )
    assert (cfg.engine.kv_pool_tokens, cfg.server.port, cfg.server.api_key) == (8192, 8123, "k")


def test_worker_serving_another_model_is_not_routed_to():
    from server.router.inflight import InflightTable
    from server.router.registry import STARTING, Registry, WorkerSpec

    class Quiet:
        def __init__(self, *a):
            pass

    reg = Registry([WorkerSpec("w0", "colocated", "tcp://x")], Quiet, InflightTable(), model_name="m")
    reg.on_stats(
        "w0",
        WorkerStats(worker_id="w0", role="colocated", model="other", capacity_tokens=10, max_model_len=10, page_size=1),
    )
    ok, why = reg.health()
    assert not ok and reg.handles["w0"].state == STARTING
    assert "serves model 'other' but the router serves 'm'" in why
    reg.on_stats(
        "w0",
        WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10, max_model_len=10, page_size=1),
    )
    assert reg.health()[0]


def test_error_on_one_pd_worker_aborts_the_request_on_the_other():
    # The decode worker fails the request (e.g. its prefill peer looked dead): the prefill worker,
    # which may still hold the prompt's KV waiting for a destination, must hear of it at once.
    from server.router.errors import APIError
    from server.router.session import GenerationSession

    class Client:
        def __init__(self):
            self.aborted = []

        def prefill(self, *a, **kw):
            pass

        def generate(self, *a, **k):
            pass

        def abort(self, rids, reason):
            self.aborted += rids

    table = InflightTable()
    specs = [WorkerSpec("p0", "prefill", "tcp://p"), WorkerSpec("d0", "decode", "tcp://d")]
    reg = Registry(specs, lambda *a: Client(), table, timeout_s=2.0, policy=ROUTING_POLICIES["pd"])
    for s in specs:
        reg.on_stats(
            s.worker_id,
            WorkerStats(
                worker_id=s.worker_id, role=s.role, model="m", capacity_tokens=100, max_model_len=100, page_size=1
            ),
        )

    async def scenario():
        session = GenerationSession(reg, table, [1, 2, 3], SamplingParams(max_new_tokens=4), timeout_s=5)
        session.prepare()
        session.send()
        reg.on_tokens("d0", TokenDelta.failed(session.rid, "prefill worker did not answer", 503))
        with pytest.raises(APIError):
            await session.next()
        return session.rid

    rid = asyncio.run(scenario())
    assert reg.handles["p0"].client.aborted == [rid] and rid not in table


def test_a_request_goes_to_a_worker_whose_pool_holds_it_when_pools_differ():
    """Pools of different sizes (``--worker-kv-pool-tokens``): the policy picks among the workers that
    can hold the request; the prefill worker needs room for the prompt alone. A request no route
    holds is routed as before and refused by the route's fit check, naming the pool."""
    from server.router.session import APIError, check_route_fits

    specs = [
        WorkerSpec("p0", "prefill", "tcp://p"),
        WorkerSpec("d0", "decode", "tcp://d0"),
        WorkerSpec("d1", "decode", "tcp://d1"),
    ]
    reg = Registry(specs, lambda *a: object(), InflightTable(), timeout_s=2.0, policy=ROUTING_POLICIES["pd"])
    for s, cap in zip(specs, (100, 100, 400)):
        reg.on_stats(
            s.worker_id,
            WorkerStats(
                worker_id=s.worker_id, role=s.role, model="m", capacity_tokens=cap, max_model_len=1000, page_size=1
            ),
        )
    prompt = list(range(60))
    assert reg.route(prompt, 30).stream_from.worker_id == "d0"  # both hold 90 tokens: least loaded, lowest id
    big = reg.route(prompt, 200)
    assert [h.worker_id for h in big.targets] == ["p0", "d1"] and big.capacity_tokens == 400
    check_route_fits(60, 200, big)  # the prefill worker holds the 60-token prompt, d1 all 260
    with pytest.raises(APIError, match=r"exceeds the KV cache pool capacity of 400 tokens"):
        check_route_fits(60, 400, reg.route(prompt, 400))
    long_prompt = list(range(150))
    with pytest.raises(APIError, match=r"prompt \(150 tokens\) exceeds the prefill worker's KV pool of 100 tokens"):
        check_route_fits(150, 10, reg.route(long_prompt, 10))
