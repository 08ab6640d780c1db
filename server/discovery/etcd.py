"""A small client of etcd's v3 JSON gateway (``/v3/...``, keys and values base64): what discovery
needs and nothing else. ``EtcdClient`` (blocking, httpx) grants, keeps alive and revokes a lease,
puts and ranges keys; ``watch_prefix`` (asyncio, httpx) streams a prefix's events from a revision
(``POST /v3/watch`` answers one JSON object per line). Every failure is an ``EtcdError`` whose
message names the endpoint and what happened.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


class EtcdError(RuntimeError):
    """etcd unreachable, or it refused or did not understand a request."""


def b64(text: str) -> str:
    """``text`` (UTF-8) as the gateway's base64."""
    return base64.b64encode(text.encode()).decode()


def unb64(data: str) -> str:
    """The gateway's base64 back to text."""
    return base64.b64decode(data).decode()


def range_end(prefix: str) -> str:
    """The exclusive end of every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass(frozen=True)
class Event:
    """One watch event: ``kind`` "PUT" (``value`` set) or "DELETE", on ``key``."""

    kind: str
    key: str
    value: str = ""


class EtcdClient:
    """Unary calls to the gateway at ``base_url`` (http://HOST:PORT); blocking."""

    def __init__(self, base_url: str, timeout_s: float = 3.0) -> None:
        self.base_url = base_url
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False)

    def _call(self, path: str, body: dict) -> dict:
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise EtcdError(f"etcd at {self.base_url} unreachable ({path}): {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise EtcdError(f"etcd at {self.base_url} answered {r.status_code} to {path}: {r.text[:300]}")
        data = r.json()
        if "error" in data:
            raise EtcdError(f"etcd at {self.base_url} refused {path}: {data.get('message') or data['error']}")
        return data

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int(self._call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL now (0 or less: the lease is gone, e.g. it expired)."""
        result = self._call("/v3/lease/keepalive", {"ID": lease}).get("result", {})
        return int(result.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: every key attached to it is deleted."""
        self._call("/v3/lease/revoke", {"ID": lease})

    def put(self, key: str, value: str, lease: int | None = None) -> None:
        """Set ``key``, attached to ``lease`` when given."""
        body = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._call("/v3/kv/put", body)

    def get_prefix(self, prefix: str) -> tuple[int, dict[str, str]]:
        """(store revision, {key: value}) of every key under ``prefix``."""
        data = self._call("/v3/kv/range", {"key": b64(prefix), "range_end": b64(range_end(prefix))})
        kvs = {unb64(kv["key"]): unb64(kv.get("value", "")) for kv in data.get("kvs", [])}
        return int(data["header"]["revision"]), kvs

    def close(self) -> None:
        self._http.close()


async def get_prefix_async(http: httpx.AsyncClient, prefix: str) -> tuple[int, dict[str, str]]:
    """``EtcdClient.get_prefix`` on an async client whose ``base_url`` is the gateway."""
    try:
        r = await http.post("/v3/kv/range", json={"key": b64(prefix), "range_end": b64(range_end(prefix))})
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise EtcdError(f"etcd at {http.base_url} unreachable (range {prefix}): {type(e).__name__}: {e}") from None
    data = r.json()
    kvs = {unb64(kv["key"]): unb64(kv.get("value", "")) for kv in data.get("kvs", [])}
    return int(data["header"]["revision"]), kvs


async def call_async(http: httpx.AsyncClient, path: str, body: dict) -> dict:
    """One unary gateway call on an async client; ``EtcdError`` when etcd is unreachable or refuses."""
    try:
        r = await http.post(path, json=body)
    except httpx.HTTPError as e:
        raise EtcdError(f"etcd at {http.base_url} unreachable ({path}): {type(e).__name__}: {e}") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200 or "error" in data:
        raise EtcdError(f"etcd at {http.base_url} refused {path}: {data.get('message') or r.text[:300]}")
    return data


async def create_if_absent(http: httpx.AsyncClient, key: str, value: str, lease: int) -> bool:
    """Put ``key`` attached to ``lease`` only if it does not exist (one transaction); True if it was put."""
    body = {
        "compare": [{"target": "CREATE", "key": b64(key), "create_revision": "0"}],
        "success": [{"request_put": {"key": b64(key), "value": b64(value), "lease": lease}}],
    }
    return bool((await call_async(http, "/v3/kv/txn", body)).get("succeeded"))


async def watch_prefix(http: httpx.AsyncClient, prefix: str, start_revision: int) -> AsyncIterator[Event]:
    """Every change under ``prefix`` from ``start_revision`` on, until the stream breaks
    (``EtcdError``: etcd went away, or compacted past ``start_revision``)."""
    body = {
        "create_request": {"key": b64(prefix), "range_end": b64(range_end(prefix)), "start_revision": start_revision}
    }
    try:
        async with http.stream("POST", "/v3/watch", json=body, timeout=httpx.Timeout(5.0, read=None)) as r:
            if r.status_code != 200:
                raise EtcdError(f"etcd at {http.base_url} answered {r.status_code} to /v3/watch")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    raise EtcdError(
                        f"etcd at {http.base_url} cancelled the watch of {prefix}: "
                        f"{result.get('cancel_reason') or 'compacted'}"
                    )
                for ev in result.get("events", []):
                    kv = ev.get("kv", {})
                    yield Event(ev.get("type", "PUT"), unb64(kv["key"]), unb64(kv.get("value", "")))
    except httpx.HTTPError as e:
        raise EtcdError(f"etcd at {http.base_url} watch of {prefix} broke: {type(e).__name__}: {e}") from None
    raise EtcdError(f"etcd at {http.base_url} ended the watch of {prefix}")
