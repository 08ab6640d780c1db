"""What a pdserve server's ``/metrics`` says about a run: prefix hit rate per side, KV shipped.

``scrape(url)`` reads the Prometheus text into ``{(name, labels): value}``. ``cache_effect(before,
after, requests)`` compares two scrapes: per worker role (prefill, decode, colocated) the share of
prompt tokens served from the workers' radix caches (``pdserve_cached_prompt_tokens_total`` over
``pdserve_prompt_tokens_total``, summed over that role's workers), and the KV bytes prefill workers
wrote into decode workers (``pdserve_kv_transfer_bytes_total``) per request. Worker series are as
new as each worker's latest heartbeat: scrape ``after`` a heartbeat interval after the last request.
A server that is not pdserve (no such series) gives an empty result, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``GET url/metrics`` (empty when the server has none)."""
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", timeout=30, trust_env=False)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _by_worker(samples: Samples, name: str) -> dict[str, float]:
    return {dict(lab)["worker"]: v for (n, lab), v in samples.items() if n == name and "worker" in dict(lab)}


@dataclass
class CacheEffect:
    """Prefix hit rate by worker role and KV bytes shipped per request over one run."""

    hit_rate: dict[str, float] = field(default_factory=dict)
    kv_bytes_per_request: float | None = None

    def to_dict(self) -> dict:
        return {"hit_rate": self.hit_rate, "kv_bytes_per_request": self.kv_bytes_per_request}


def cache_effect(before: Samples, after: Samples, requests: int) -> CacheEffect:
    """The ``CacheEffect`` between two scrapes of the same server (see the module docstring)."""
    roles = {dict(lab)["worker"]: dict(lab)["role"] for (n, lab), _ in after.items() if n == "pdserve_worker_up"}
    out = CacheEffect()
    prompt = {
        w: v - _by_worker(before, "pdserve_prompt_tokens_total").get(w, 0.0)
        for w, v in _by_worker(after, "pdserve_prompt_tokens_total").items()
    }
    cached = {
        w: v - _by_worker(before, "pdserve_cached_prompt_tokens_total").get(w, 0.0)
        for w, v in _by_worker(after, "pdserve_cached_prompt_tokens_total").items()
    }
    for role in sorted(set(roles.values())):
        p = sum(v for w, v in prompt.items() if roles.get(w) == role)
        if p > 0:
            out.hit_rate[role] = sum(v for w, v in cached.items() if roles.get(w) == role) / p
    shipped = _by_worker(after, "pdserve_kv_transfer_bytes_total")
    if shipped and requests:
        before_bytes = _by_worker(before, "pdserve_kv_transfer_bytes_total")
        out.kv_bytes_per_request = sum(v - before_bytes.get(w, 0.0) for w, v in shipped.items()) / requests
    return out
