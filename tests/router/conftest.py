"""Fixtures of the router's tests: ``make_client``, a router app on the scripted fake worker of
tests/support/fake_worker.py (FastAPI TestClient, no model)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from configs.schema import PdserveConfig
from server.router.app import build_context, create_app
from server.router.registry import WorkerSpec
from tests.support.fake_worker import FakeWorker


@pytest.fixture
def make_client(tokenizer):
    """``make_client(mode=..., **server_settings)`` -> (TestClient, fake worker); closed after the test."""
    made = []

    def make(mode: dict | None = None, **server):
        mode = {} if mode is None else mode
        cfg = PdserveConfig.model_validate(
            {"server": {"health_interval_s": 0.05, **server}, "cluster": {"mode": "colocated"}}
        )
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
