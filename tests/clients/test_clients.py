"""The ecosystem's load generators, unmodified, against real launched servers in both modes:
guidellm 0.8.1 (the vLLM project's benchmark tool; its chat requests stream with vLLM's
``stream_options.continuous_usage_stats``) and NVIDIA's aiperf 0.13, a few dozen streamed chat
requests each, every one answered without error. The clients live in their own venv
(``make test-clients`` builds .venv-clients and sets PDSERVE_CLIENTS_VENV); they count tokens with
the served model's own tokenizer, exported for transformers (``Tokenizer.save_hf_folder``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.harness.subprocess_server import wait_idle

pytestmark = pytest.mark.process

VENV = Path(os.environ.get("PDSERVE_CLIENTS_VENV", Path(__file__).resolve().parents[2] / ".venv-clients"))
REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 24, 8, 48, 12
HEARTBEAT_S = 0.5
MODES = {"pd": ("--kv-pool-tokens", "4096"), "colocated": ("--kv-pool-tokens", "4096")}


def client_env() -> dict[str, str]:
    """The clients' environment: no proxy for loopback. (Not HF_HUB_OFFLINE: in offline mode aiperf
    looks a tokenizer up in the hub cache by repo id and refuses a local folder.)"""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "NO_PROXY": "127.0.0.1,localhost"}


def run_client(argv: list[str], log: Path) -> None:
    with log.open("w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=client_env(), timeout=900)
    assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="module")
def tok_folder(tokenizer, tmp_path_factory) -> Path:
    if not (VENV / "bin" / "guidellm").exists() or not (VENV / "bin" / "aiperf").exists():
        pytest.skip(f"guidellm/aiperf are not installed in {VENV}: run `make test-clients`")
    return tokenizer.save_hf_folder(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def servers(launched_server, tok_folder) -> dict:
    """One launched server per mode, started on first use."""
    started: dict = {}

    def get(mode: str):
        if mode not in started:
            started[mode] = launched_server(
                mode, *MODES[mode], "--health-interval-s", str(HEARTBEAT_S), "--log-level", "WARNING"
            )
        return started[mode]

    return get


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("mode", list(MODES))
def test_guidellm_runs_without_errors(servers, tok_folder, tmp_path, mode):
    url = servers(mode).url
    report = tmp_path / "guidellm.json"
    run_client(
        [
            str(VENV / "bin" / "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={url}",
            "--profile",
            f"kind=concurrent,streams={CONCURRENCY}",
            "--constraint",
            f"kind=max_requests,count={REQUESTS}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tok_folder}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ],
        tmp_path / "guidellm.log",
    )
    totals = json.loads(report.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (REQUESTS, 0, 0), totals
    m = wait_idle(url, HEARTBEAT_S, timeout_s=60)
    assert sum(v for (n, lab), v in m.items() if n == "pdserve_kv_pool_pages" and dict(lab).get("state") == "used") == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_aiperf_runs_without_errors(servers, tok_folder, tmp_path, mode):
    url = servers(mode).url
    out = tmp_path / "aiperf"
    run_client(
        [
            str(VENV / "bin" / "aiperf"),
            "profile",
            "--model",
            _model(url),
            "--url",
            url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--request-count",
            str(REQUESTS),
            "--concurrency",
            str(CONCURRENCY),
            "--tokenizer",
            str(tok_folder),
            "--prompt-input-tokens-mean",
            str(PROMPT_TOKENS),
            "--prompt-input-tokens-stddev",
            "0",
            "--prompt-output-tokens-mean",
            str(OUTPUT_TOKENS),
            "--prompt-output-tokens-stddev",
            "0",
            "--output-artifact-dir",
            str(out),
            "--ui",
            "none",
        ],
        tmp_path / "aiperf.log",
    )
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert report["error_summary"] == [], report["error_summary"]
    assert report["completed_request_count"]["avg"] == REQUESTS
    assert report["request_error_rate"]["avg"] == 0
    m = wait_idle(url, HEARTBEAT_S, timeout_s=60)
    assert sum(v for (n, lab), v in m.items() if n == "pdserve_kv_pool_pages" and dict(lab).get("state") == "used") == 0
