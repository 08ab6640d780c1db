"""The dtype of a default launch: ``--dtype auto`` runs the embedded (quantized) model in bfloat16 on
a CPU with native bf16 and logs why; the test session itself pins the exact float32 mode
(``PDSERVE_DTYPE``, tests/conftest.py) for every process and config that reads the environment."""

from __future__ import annotations

import os

import httpx
import pytest

from engine.cpu_features import has_fast_bf16

pytestmark = pytest.mark.process


@pytest.mark.skipif(has_fast_bf16() is not True, reason="this CPU has no AVX512-BF16/AMX: auto stays float32")
def test_a_default_launch_runs_the_embedded_model_in_bfloat16(launched_server_per_test):
    """``pdserve launch`` with no ``--dtype`` and no ``PDSERVE_DTYPE``: the worker logs bfloat16 with
    its reason, and serves."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_DTYPE"}
    srv = launched_server_per_test("colocated", "--kv-pool-tokens", "1024", "--log-level", "INFO", env=env)
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    log = srv.log()
    assert "dtype: bfloat16 (auto on CPU with quantized weights and native bf16 instructions)" in log, log[-3000:]
    assert "dtype: float32" not in log
