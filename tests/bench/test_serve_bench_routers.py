"""``pdserve bench serve`` against several routers of one deployment: ``--base-url a,b`` and
``--target NAME=a,b`` send requests round-robin by request index (in process, mock HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from bench.serve.client import ClientConfig, send, split_urls
from bench.serve.options import ServeOptions, add_serve_flags
from bench.serve.workload import RequestSpec


def _opts(*argv: str) -> ServeOptions:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return ServeOptions.from_args(p.parse_args(list(argv)))


def _chunk(text: str) -> str:
    return json.dumps({"choices": [{"text": text}]})


def _mock_client(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def test_several_routers_are_loaded_round_robin_by_request_index():
    sse = f"data: {_chunk('x')}\n\ndata: [DONE]\n\n"
    hosts = []

    def ok(request: httpx.Request) -> httpx.Response:
        hosts.append(f"{request.url.host}:{request.url.port}")
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    urls = split_urls("http://r1:8000, http://r2:8001/", "--base-url")
    assert urls == ("http://r1:8000", "http://r2:8001")
    cfg = ClientConfig(urls[0], "m", base_urls=urls)

    async def five():
        async with _mock_client(ok) as c:
            return [await send(c, cfg, RequestSpec(i, "p", 4, 1)) for i in range(5)]

    assert all(r.ok for r in asyncio.run(five()))
    assert hosts == ["r1:8000", "r2:8001", "r1:8000", "r2:8001", "r1:8000"]
    assert ClientConfig("http://one", "m").url_for(7) == "http://one"
    o = _opts("--target", "two=http://r1:8000,http://r2:8001/", "--base-url", "http://a:1,http://b:2")
    assert o.targets == (("two", "http://r1:8000,http://r2:8001"),)
    for argv, msg in (
        (("--base-url", "http://a:1,b:2"), "--base-url takes http"),
        (("--base-url", "http://a:1,http://a:1"), "twice"),
        (("--target", "two=http://a:1,"), "--target takes http"),
    ):
        with pytest.raises(ValueError, match=msg):
            _opts(*argv)
