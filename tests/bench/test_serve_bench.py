"""``pdserve bench serve``: statistics against hand-computed values, the SSE recorder and client
over real httpx (mock transport), and one short real run that launches a colocated server with the
embedded model. The workload: tests/bench/test_serve_workload.py; options and reports:
tests/bench/test_serve_options.py. Nothing here asserts on speed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import fields

import httpx
import pytest

from bench.harness.subprocess_server import REPO_ROOT, free_port
from bench.serve.client import ClientConfig, RequestResult, StreamRecorder, request_body, send
from bench.serve.runner import closed_loop
from bench.serve.stats import SLO, RunStats, compute_stats, percentile, summarize
from bench.serve.workload import PromptShape, RequestSpec, WordCounter, make_requests


def result(ttft, e2e, n, itl=(), ok=True, kind="main", prompt=10, expected=None, error=None) -> RequestResult:
    return RequestResult(
        0,
        kind,
        ok,
        prompt,
        n if expected is None else expected,
        ttft_s=ttft,
        e2e_s=e2e,
        itl_s=list(itl),
        prompt_tokens=prompt,
        output_tokens=n,
        usage_reported=True,
        error=error,
    )


# ---- stats ----------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == 99
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summarize_in_ms():
    s = summarize([0.1, 0.2, 0.3, 0.4])
    assert s.count == 4
    assert s.mean_ms == pytest.approx(250) and s.p50_ms == pytest.approx(250) and s.p99_ms == pytest.approx(397)
    assert summarize([]) is None


def test_tpot_itl_e2e_definitions():
    # TTFT 1.0 s, then tokens at +0.2, +0.3, +0.5 s: E2E 2.0, TPOT (2.0 - 1.0) / 3
    r = result(1.0, 2.0, 4, itl=[0.2, 0.3, 0.5])
    assert r.tpot_s == pytest.approx(1 / 3)
    assert result(1.0, 1.0, 1).tpot_s is None  # one token: no TPOT
    assert result(1.0, 2.0, 4, ok=False, error="x").tpot_s is None
    a, b = result(0.5, 1.5, 3, itl=[0.4, 0.6]), result(1.0, 3.0, 5, itl=[0.5, 0.5, 0.5, 0.5])
    failed = result(None, 0.1, 0, ok=False, error="HTTP 500: boom")
    s = compute_stats([a, b, failed], duration_s=4.0)
    assert (s.requests, s.completed, s.failed) == (3, 2, 1)
    assert s.errors == ["HTTP 500: boom"]
    assert s.output_tokens == 8 and s.output_throughput == pytest.approx(2.0)
    assert s.request_throughput == pytest.approx(0.5) and s.input_tokens == 20
    assert s.ttft.mean_ms == pytest.approx(750) and s.ttft.p50_ms == pytest.approx(750)
    assert s.tpot.count == 2 and s.tpot.mean_ms == pytest.approx((500 + 500) / 2)
    assert s.itl.count == 6 and s.itl.mean_ms == pytest.approx(3000 / 6)  # pooled over requests
    assert s.itl.p99_ms == pytest.approx(600 - 0.05 * 100)  # sorted [.4 .5 .5 .5 .5 .6]: pos 4.95
    assert s.e2e.p99_ms == pytest.approx(1500 + 0.99 * 1500)
    assert s.goodput is None and s.output_len_mismatches == 0


def test_goodput_counts_requests_meeting_every_slo():
    fast = result(0.1, 0.5, 5)  # TPOT 100 ms
    slow_tpot = result(0.1, 2.1, 5)  # TPOT 500 ms
    slow_ttft = result(2.0, 2.4, 5)  # TPOT 100 ms
    failed = result(None, 0.1, 0, ok=False, error="e")
    s = compute_stats([fast, slow_tpot, slow_ttft, failed], 2.0, SLO(ttft_ms=1000, tpot_ms=200))
    assert s.goodput_requests == 1 and s.goodput == pytest.approx(0.5)
    assert compute_stats([fast, slow_tpot, slow_ttft], 2.0, SLO(ttft_ms=1000)).goodput_requests == 2
    assert compute_stats([fast, slow_tpot, slow_ttft], 2.0, SLO(tpot_ms=200)).goodput_requests == 2


def test_output_length_mismatch_is_counted():
    s = compute_stats([result(0.1, 0.5, 5, expected=8), result(0.1, 0.5, 8, expected=8)], 1.0)
    assert s.output_len_mismatches == 1


# ---- the SSE recorder and the client ----------------------------------------------------------------
def _chunk(text: str) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def test_stream_recorder_times_and_usage():
    rec = StreamRecorder(RequestResult(3, "main", False, 5, 3, start_s=10.0))
    rec.feed(_chunk(""), 10.1)  # no text (e.g. a held-back partial UTF-8 token): not the first token
    rec.feed(_chunk("a"), 10.5)
    rec.feed(_chunk("b"), 10.7)
    rec.feed(json.dumps({"choices": [{"delta": {"content": "c"}}]}), 11.0)  # chat shape
    rec.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}), 11.0)
    rec.feed("[DONE]", 11.0)
    r = rec.finish(11.1)
    assert r.ok and r.error is None
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.1)
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert (r.output_tokens, r.prompt_tokens, r.usage_reported) == (3, 5, True)
    assert r.tpot_s == pytest.approx(0.6 / 2)


def test_stream_recorder_failures_are_explicit():
    rec = StreamRecorder(RequestResult(0, "main", False, 5, 3, start_s=0.0))
    rec.feed(_chunk("a"), 0.1)
    assert not rec.finish(0.2).ok and rec.r.error == "stream ended before data: [DONE]"
    rec = StreamRecorder(RequestResult(0, "main", False, 5, 3, start_s=0.0))
    rec.feed(json.dumps({"error": {"message": "KV pool too small", "type": "server_error"}}), 0.1)
    rec.feed("[DONE]", 0.1)
    assert not rec.finish(0.2).ok and rec.r.error == "KV pool too small"
    rec = StreamRecorder(RequestResult(0, "main", False, 5, 3, start_s=0.0))
    rec.feed(_chunk("a"), 0.1)
    rec.feed(_chunk("b"), 0.2)
    rec.feed("[DONE]", 0.2)
    r = rec.finish(0.3)
    assert r.ok and r.output_tokens == 2 and not r.usage_reported  # no usage: text chunks counted


def test_request_body_shapes():
    spec = RequestSpec(0, "hello", 1, 7)
    body = request_body(ClientConfig("http://x", "m"), spec)
    assert body["prompt"] == "hello" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    chat = request_body(ClientConfig("http://x", "m", endpoint="chat", ignore_eos=False), spec)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "ignore_eos" not in chat


def _mock_client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_send_parses_a_real_httpx_stream_and_reports_http_errors():
    sse = (
        "".join(f"data: {_chunk(t)}\n\n" for t in ("x", "y"))
        + 'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    )
    seen = {}

    def ok(request: httpx.Request) -> httpx.Response:
        seen.update(path=request.url.path, body=json.loads(request.content))
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})

    cfg, spec = ClientConfig("http://srv", "m"), RequestSpec(0, "p", 4, 2)
    r = asyncio.run(_send_with(ok, cfg, spec))
    assert r.ok and r.output_tokens == 2 and r.prompt_tokens == 4 and len(r.itl_s) == 1
    assert seen["path"] == "/v1/completions" and seen["body"]["model"] == "m"
    r = asyncio.run(_send_with(refuse, cfg, spec))
    assert not r.ok and r.error.startswith("HTTP 400") and "prompt too long" in r.error

    def garbled(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text='data: {"choices": [7]}\n\ndata: not json\n\n')

    r = asyncio.run(_send_with(garbled, cfg, spec))
    assert not r.ok and r.error.startswith("AttributeError")


async def _send_with(handler, cfg, spec):
    async with _mock_client(handler) as c:
        return await send(c, cfg, spec)


def test_unreachable_server_fails_every_request_and_none_is_dropped():
    cfg = ClientConfig(f"http://127.0.0.1:{free_port()}", "m", timeout_s=10)
    specs = make_requests(PromptShape(3, 4, 4, 2), WordCounter(), seed=0)
    m = asyncio.run(closed_loop(cfg, specs, concurrency=2, progress=False))
    assert [r.index for r in m.results] == [0, 1, 2]
    assert all(not r.ok and "ConnectError" in r.error for r in m.results)
    s = compute_stats(m.results, m.duration_s)
    assert (s.completed, s.failed, s.ttft) == (0, 3, None)


# ---- a real run -------------------------------------------------------------------------------------
@pytest.mark.process
def test_real_run_against_a_launched_colocated_server(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [
        sys.executable,
        "-m",
        "server.launch.cli",
        "bench",
        "serve",
        "--compare",
        "colocated",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--output-len",
        "8",
        "--input-len-range",
        "16,32",
        "--warmup",
        "1",
        "--kv-pool-tokens",
        "2048",
        "--max-model-len",
        "512",
        "--slo-ttft-ms",
        "600000",
        "--out",
        str(out),
        "--plot",
        str(png),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["tokenizer"] == "tokenizer:default" and data["ratios"] == {}
    (run,) = data["runs"]
    assert (run["target"], run["load"], run["concurrency"], run["kind"]) == ("colocated", "c=2", 2, "all")
    stats = run["stats"]
    assert set(stats) == {f.name for f in fields(RunStats)}
    assert (stats["requests"], stats["completed"], stats["failed"], stats["errors"]) == (4, 4, 0, [])
    assert stats["output_tokens"] == 32 and stats["output_len_mismatches"] == 0
    assert stats["goodput_requests"] == 4
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert set(stats[name]) == {"count", "mean_ms", "p50_ms", "p99_ms"}
        assert 0 < stats[name]["p50_ms"] <= stats[name]["p99_ms"]
    assert stats["tpot"]["count"] == 4 and stats["itl"]["count"] <= 4 * 7
    assert len(run["requests"]) == 4
    for r in run["requests"]:
        assert r["ok"] and r["usage_reported"] and r["output_tokens"] == 8
        assert r["prompt_tokens"] == r["expected_prompt_len"] and 16 <= r["prompt_tokens"] <= 32
        assert 0 < r["ttft_s"] < r["e2e_s"]
    assert "| colocated | c=2 | all | 4 | 0 |" in proc.stdout
    for proc_name in ("router", "colocated-0"):  # CPU of the launched processes over the measured requests
        assert run["cpu_s"][proc_name] > 0 and run["cpu_s_per_output_token"][proc_name] > 0
    assert run["router_core_pct_per_100_tok_s"] > 0 and 0 < run["cpu_wall_s"] <= stats["duration_s"] + 0.5
    assert "CPU of colocated's processes" in proc.stdout and "| c=2 | colocated-0 |" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_failures_in_json_and_exit_code(tmp_path, capsys):
    from bench.cli import main

    out = tmp_path / "f.json"
    rc = main(
        [
            "serve",
            "--base-url",
            f"http://127.0.0.1:{free_port()}",
            "--served-model-name",
            "m",
            "--tokenizer",
            "words",
            "--num-prompts",
            "3",
            "--concurrency",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert rc == 1
    stats = json.loads(out.read_text())["runs"][0]["stats"]
    assert (stats["requests"], stats["completed"], stats["failed"]) == (3, 0, 3)
    printed = capsys.readouterr().out
    assert "ConnectError" in stats["errors"][0] and "3 request(s) failed" in printed
    run = json.loads(out.read_text())["runs"][0]  # not launched by the bench: no pids, no CPU figures
    assert run["cpu_s"] is None and run["router_core_pct_per_100_tok_s"] is None
    assert "CPU per process: not measured for server" in printed
    assert main(["serve", "--concurrency", "1", "--request-rate", "2"]) == 2
