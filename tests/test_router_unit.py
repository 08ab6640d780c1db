"""Router units without a model: the HTTP layer against scripted fake workers (FastAPI TestClient),
stop strings, the registry's liveness rules, and the launcher's startup failure path."""
from __future__ import annotations

import asyncio
import io
import json
import sys

import pytest
from fastapi.testclient import TestClient

from configs.schema import PdserveConfig
from transfer.wire.protocol import TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams
from server.router.app import build_context, create_app
from server.router.detok import TextStream
from server.router.inflight import InflightTable
from server.router.registry import DEAD, READY, ROUTING_POLICIES, Registry, WorkerSpec
from server.router.worker_client import WorkerUnavailable

CAPACITY, CONTEXT = 256, 512
PIECES = [" Paris", " is", " the", " capital", " of", " France", "."]


class FakeWorker:
    """A worker client double: answers heartbeats at once and plays ``mode`` for each request."""

    def __init__(self, spec: WorkerSpec, on_tokens, on_stats, tokenizer, mode: dict) -> None:
        self.spec, self.on_tokens, self.on_stats = spec, on_tokens, on_stats
        self.tok, self.mode = tokenizer, mode
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def request_stats(self, nonce: int) -> None:
        if self.mode.get("silent"):
            return
        self.on_stats(self.spec.worker_id, WorkerStats(nonce=nonce, worker_id=self.spec.worker_id, role="colocated",
                                                       model="fake-model", capacity_tokens=CAPACITY, max_model_len=CONTEXT,
                                                       page_size=16, gauges={"kv_pages_used": 0.0}))

    def abort(self, rids: list[str], reason: str) -> None:
        self.aborted += rids

    def generate(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.mode.get("unreachable"):
            raise WorkerUnavailable("fake worker is not accepting messages")
        self.requests.append((rid, prompt_ids, params))
        asyncio.get_running_loop().create_task(self._play(rid, len(prompt_ids), params))

    async def _play(self, rid: str, n_prompt: int, params: SamplingParams) -> None:
        if self.mode.get("hang"):
            return
        if "error" in self.mode:
            status, msg = self.mode["error"]
            self.on_tokens(self.spec.worker_id, TokenDelta.failed(rid, msg, status))
            return
        ids = [t for p in PIECES for t in self.tok.encode(p)][:params.max_new_tokens]
        for i, t in enumerate(ids):
            await asyncio.sleep(0.001)
            if rid in self.aborted:
                return
            last = i == len(ids) - 1
            finish = ("stop" if len(ids) < params.max_new_tokens else "length") if last else None
            delta = TokenDelta(rid=rid, token_ids=[t], logprobs=[-0.5], top_logprobs=[[(t, -0.5)]],
                               finish_reason=finish, prompt_tokens=n_prompt)
            self.on_tokens(self.spec.worker_id, delta)


@pytest.fixture
def make_client(tokenizer):
    """``make_client(mode=..., **server_settings)`` -> (TestClient, fake worker); closed after the test."""
    made = []

    def make(mode: dict | None = None, **server):
        mode = {} if mode is None else mode
        cfg = PdserveConfig.model_validate({"server": {"health_interval_s": 0.05, **server},
                                            "cluster": {"mode": "colocated"}})
        workers = []

        def factory(spec, on_tokens, on_stats):
            workers.append(FakeWorker(spec, on_tokens, on_stats, tokenizer, mode))
            return workers[-1]

        ctx = build_context(cfg, tokenizer, "fake-model", [WorkerSpec("w0", "colocated", "inproc://w0")], factory)
        client = TestClient(create_app(ctx))
        client.__enter__()
        made.append(client)
        if not mode.get("silent"):
            assert client.get("/health").status_code == 200
        return client, workers[0], ctx

    yield make
    for c in made:
        c.__exit__(None, None, None)


def completion(client, headers=None, **body):
    return client.post("/v1/completions", json={"prompt": "The capital of France", "max_tokens": 16, **body},
                       headers=headers or {})


def sse_events(text: str) -> list:
    return [ln.removeprefix("data: ") for ln in text.split("\n\n") if ln.startswith("data: ")]


# ---- HTTP layer --------------------------------------------------------------------------------
def test_completion_and_usage(make_client):
    client, worker, ctx = make_client()
    r = completion(client, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "".join(PIECES)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert len(ctx.table) == 0 and worker.aborted == []


def test_batch_prompts_run_concurrently(make_client):
    client, worker, _ = make_client()
    r = completion(client, prompt=["a", "b", "c"], max_tokens=3)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert len(worker.requests) == 3 and r.json()["usage"]["completion_tokens"] == 9


def test_api_key(make_client):
    client, _, _ = make_client(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = completion(client, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
    assert completion(client, {"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_body_limit(make_client):
    client, worker, _ = make_client(max_body_bytes=2048)
    r = completion(client, prompt="x" * 4000)
    assert r.status_code == 413 and "2048 bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and worker.requests == []


@pytest.mark.parametrize("status,msg", [(500, "KV cache pool is too small for this request"),
                                        (400, "prompt (5 tokens) exceeds something")])
def test_worker_error_is_passed_on(make_client, status, msg):
    client, _, ctx = make_client({"error": (status, msg)})
    for stream in (False, True):
        r = completion(client, stream=stream)
        assert r.status_code == status and r.json()["error"]["message"] == msg
    assert len(ctx.table) == 0


def test_router_checks_capacity_before_sending(make_client):
    client, worker, _ = make_client()
    r = completion(client, max_tokens=CAPACITY)
    assert r.status_code == 400 and f"KV cache pool capacity of {CAPACITY} tokens" in r.json()["error"]["message"]
    assert worker.requests == []


def test_unreachable_worker_is_503(make_client):
    client, _, ctx = make_client({"unreachable": True})
    r = completion(client)
    assert r.status_code == 503 and "not accepting" in r.json()["error"]["message"]
    assert len(ctx.table) == 0


def test_timeout_aborts_in_worker(make_client):
    client, worker, ctx = make_client({"hang": True}, request_timeout_s=0.3)
    r = completion(client)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert worker.aborted == [worker.requests[0][0]] and len(ctx.table) == 0


def test_chat_stream_shape_and_stop_string(make_client):
    client, worker, _ = make_client()
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "stop": ["capital of"],
        "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " Paris is the "
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 4
    assert worker.aborted == [worker.requests[0][0]]  # the stop string ended it in the worker too


def test_validation_and_model_errors(make_client):
    client, _, _ = make_client()
    r = completion(client, temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = completion(client, model="other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                  "top_logprobs": 1, "max_tokens": 2})
    lp = r.json()["choices"][0]["logprobs"]["content"]
    assert len(lp) == 2 and lp[0]["top_logprobs"][0]["logprob"] == -0.5
    assert client.get("/nope").json()["error"]["type"] == "not_found_error"


def test_metrics_exposition(make_client):
    client, _, _ = make_client()
    completion(client)
    completion(client, max_tokens=0)
    text = client.get("/metrics").text
    for needle in ('pdserve_requests_total{status="200"} 1.0', 'pdserve_requests_total{status="400"} 1.0',
                   "pdserve_ttft_seconds_count 1.0", 'pdserve_kv_pool_pages{state="used",worker="w0"} 0.0',
                   'pdserve_retractions_total{worker="w0"}', 'pdserve_worker_up{role="colocated",worker="w0"} 1.0'):
        assert needle in text


def test_health_503_while_worker_silent(make_client):
    client, _, _ = make_client({"silent": True})
    r = client.get("/health")
    assert r.status_code == 503 and "waiting for its first heartbeat" in r.json()["workers"]
    r = completion(client)
    assert r.status_code == 503 and "no worker available" in r.json()["error"]["message"]


# ---- units ---------------------------------------------------------------------------------------
def test_text_stream_stop_across_tokens(tokenizer):
    ids = [tokenizer.encode(p) for p in PIECES]
    s = TextStream(tokenizer, stop=["the capital"])
    out = "".join(s.push(i) for i in ids[:4])
    assert s.stopped and out == " Paris is "
    assert s.push(ids[4]) == "" and s.finish() == ""
    s = TextStream(tokenizer, stop=["nowhere", ""])
    out = "".join(s.push(i) for i in ids) + s.finish()
    assert out == "".join(PIECES) and not s.stopped


def test_registry_marks_silent_worker_dead_and_fails_requests():
    now = [0.0]

    class Client:
        aborted: list = []

        def abort(self, rids, reason):
            self.aborted += rids

    table = InflightTable()
    reg = Registry([WorkerSpec("w0", "colocated", "x")], lambda *a: Client(), table, timeout_s=2.0,
                   clock=lambda: now[0])
    assert reg.health() == (False, "w0 (colocated): starting: waiting for its first heartbeat")
    reg.on_stats("w0", WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10,
                                   max_model_len=10, page_size=1))
    assert reg.health()[0] and reg.route().stream_from.worker_id == "w0"

    async def scenario():
        entry = table.open("r1", ("w0",), "w0", 5)
        now[0] = 2.5
        reg.check_liveness()
        return entry.queue.get_nowait()

    err = asyncio.run(scenario())
    assert (err.error_status, err.token_ids) == (503, []) and "no heartbeat for 2.5s" in err.error
    assert reg.handles["w0"].state == DEAD and reg.handles["w0"].client.aborted == ["r1"]
    reg.on_stats("w0", WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10,
                                   max_model_len=10, page_size=1))
    assert reg.handles["w0"].state == READY
    reg.mark_dead("w0", "worker process exited with code 1", permanent=True)
    reg.on_stats("w0", WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10,
                                   max_model_len=10, page_size=1))
    assert reg.handles["w0"].state == DEAD


@pytest.mark.process  # the launcher starts a (failing) worker process
def test_launch_fails_when_worker_dies_at_startup(capsys):
    from server.launch.launcher import Launcher, LaunchError, worker_specs

    from server.testing.subprocess_server import free_port

    cfg = PdserveConfig.model_validate({"server": {"port": 0}, "cluster": {"mode": "colocated",
                                                                          "base_port": free_port()}})
    die = [sys.executable, "-c", "import sys; print('worker: no such model', file=sys.stderr); sys.exit(3)"]
    out = io.StringIO()
    rc = asyncio.run(Launcher(cfg, argv=lambda spec, c: die, out=out, install_signals=False).run())
    assert rc == 1 and out.getvalue() == ""
    assert "worker colocated-0 (colocated) exited with code 3 during startup" in capsys.readouterr().err


def test_pd_worker_specs_and_routing():
    from server.launch.launcher import worker_specs
    from server.router.registry import Route, WorkerHandle, route_pd, send_request

    specs = worker_specs(PdserveConfig.model_validate({"cluster": {"mode": "pd", "prefill": 2, "decode": 1,
                                                                   "base_port": 30000}}))
    assert [(s.worker_id, s.role, s.addr) for s in specs] == [
        ("prefill-0", "prefill", "tcp://127.0.0.1:30000"), ("prefill-1", "prefill", "tcp://127.0.0.1:30001"),
        ("decode-0", "decode", "tcp://127.0.0.1:30002")]

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
    assert handles[2].client.calls == [("generate", ("r1", [1, 2, 3], params),
                                        {"room": 77, "prefill_addr": "tcp://127.0.0.1:30001"})]
    assert isinstance(route, Route)


def test_launch_refuses_unknown_config_keys(tmp_path, capsys):
    from server.launch.cli import main

    preset = tmp_path / "bad.yaml"
    preset.write_text("server:\n  port: 8001\n  colour: blue\n")
    assert main(["launch", "--config", str(preset)]) == 2
    assert "colour" in capsys.readouterr().err


def test_small_preset_loads_and_flags_win():
    from configs.schema import load_config
    from server.testing.subprocess_server import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs/presets/colocated-small.yaml", {"port": 8123},
                      environ={"PDSERVE_API_KEY": "k"})
    assert (cfg.engine.kv_pool_tokens, cfg.server.port, cfg.server.api_key) == (8192, 8123, "k")


def test_worker_serving_another_model_is_not_routed_to():
    from server.router.inflight import InflightTable
    from server.router.registry import STARTING, Registry, WorkerSpec

    class Quiet:
        def __init__(self, *a):
            pass

    reg = Registry([WorkerSpec("w0", "colocated", "tcp://x")], Quiet, InflightTable(), model_name="m")
    reg.on_stats("w0", WorkerStats(worker_id="w0", role="colocated", model="other", capacity_tokens=10,
                                   max_model_len=10, page_size=1))
    ok, why = reg.health()
    assert not ok and reg.handles["w0"].state == STARTING
    assert "serves model 'other' but the router serves 'm'" in why
    reg.on_stats("w0", WorkerStats(worker_id="w0", role="colocated", model="m", capacity_tokens=10,
                                   max_model_len=10, page_size=1))
    assert reg.health()[0]


def test_error_on_one_pd_worker_aborts_the_request_on_the_other():
    # The decode worker fails the request (e.g. its prefill peer looked dead): the prefill worker,
    # which may still hold the prompt's KV waiting for a destination, must hear of it at once.
    from server.router.errors import APIError
    from server.router.session import GenerationSession

    class Client:
        def __init__(self):
            self.aborted = []

        def prefill(self, *a):
            pass

        def generate(self, *a, **k):
            pass

        def abort(self, rids, reason):
            self.aborted += rids

    table = InflightTable()
    specs = [WorkerSpec("p0", "prefill", "tcp://p"), WorkerSpec("d0", "decode", "tcp://d")]
    reg = Registry(specs, lambda *a: Client(), table, timeout_s=2.0, policy=ROUTING_POLICIES["pd"])
    for s in specs:
        reg.on_stats(s.worker_id, WorkerStats(worker_id=s.worker_id, role=s.role, model="m", capacity_tokens=100,
                                              max_model_len=100, page_size=1))

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
