"""One streamed OpenAI request (``/v1/completions`` or ``/v1/chat/completions``) -> ``RequestResult``.

Times are ``time.perf_counter()`` seconds. TTFT is the arrival of the first chunk carrying text;
ITLs are the gaps between later text chunks; the output token count is the server's
``usage.completion_tokens`` (``stream_options.include_usage``), or the number of text chunks when a
server sends no usage (``usage_reported`` is then False). Any HTTP error, error event, transport
error or empty stream makes ``ok`` False with the reason in ``error``: nothing is dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from bench.serve.workload import RequestSpec


@dataclass
class RequestResult:
    """What one request did. Latencies in seconds; ``tpot_s`` = (E2E - TTFT) / (output tokens - 1)."""

    index: int
    kind: str
    ok: bool
    expected_prompt_len: int
    expected_output_len: int
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    error: str | None = None
    output_text: str = ""  # what the stream said (multi-turn conversations append it to the next turn)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send: ``endpoint`` is ``completions`` or ``chat``. ``base_urls``: several
    routers in front of the same workers, taken round-robin by request index (``url_for``); empty:
    ``base_url`` alone."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    timeout_s: float = 600.0
    base_urls: tuple[str, ...] = ()

    def url_for(self, index: int) -> str:
        """The server request ``index`` goes to: ``base_urls[index % n]``, or ``base_url``."""
        return self.base_urls[index % len(self.base_urls)] if self.base_urls else self.base_url


def split_urls(text: str, flag: str) -> tuple[str, ...]:
    """``"http://a:8000,http://b:8001/"`` -> ``("http://a:8000", "http://b:8001")``; ``ValueError``
    naming ``flag`` for an entry that is not an http(s) URL or a URL given twice."""
    urls = tuple(u.strip().rstrip("/") for u in text.split(","))
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(
                f"{flag} takes http://HOST:PORT, or several comma-separated (routers of one "
                f"deployment, loaded round-robin); got {u!r} in {text!r}"
            )
    if len(set(urls)) != len(urls):
        raise ValueError(f"{flag}: {text!r} names a URL twice")
    return urls


def request_body(cfg: ClientConfig, spec: RequestSpec) -> dict:
    """The JSON body for ``spec``: greedy, streamed, with usage and (by default) ``ignore_eos``."""
    body: dict = {
        "model": cfg.model,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        turns = spec.messages or (("user", spec.prompt),)
        body["messages"] = [{"role": role, "content": content} for role, content in turns]
    else:
        body["prompt"] = spec.prompt
    return body


def _chunk_text(event: dict) -> str:
    text = ""
    for c in event.get("choices") or []:
        text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


class StreamRecorder:
    """Folds SSE ``data:`` payloads into a ``RequestResult`` (separate from I/O so it is unit-testable)."""

    def __init__(self, result: RequestResult) -> None:
        self.r = result
        self._last: float | None = None
        self._chunks = 0
        self.done = False

    def feed(self, data: str, now: float) -> None:
        """One ``data:`` payload received at ``now`` (perf_counter seconds)."""
        if data.strip() == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            self.r.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if text := _chunk_text(event):
            self.r.output_text += text
            if self._last is None:
                self.r.ttft_s = now - self.r.start_s
            else:
                self.r.itl_s.append(now - self._last)
            self._last = now
            self._chunks += 1
        if event.get("usage"):
            self.r.usage_reported = True
            self.r.output_tokens = int(event["usage"].get("completion_tokens", 0))
            self.r.prompt_tokens = event["usage"].get("prompt_tokens")

    def finish(self, now: float) -> RequestResult:
        """Close the record: E2E, the token count, and ``ok`` with a reason when it failed."""
        r = self.r
        r.e2e_s = now - r.start_s
        if not r.usage_reported:
            r.output_tokens = self._chunks
        if r.error is None and not self.done:
            r.error = "stream ended before data: [DONE]"
        if r.error is None and self._chunks == 0:
            r.error = "stream ended without any output text"
        r.ok = r.error is None
        return r


async def send(client: httpx.AsyncClient, cfg: ClientConfig, spec: RequestSpec) -> RequestResult:
    """Send ``spec`` and stream the answer; never raises for request-level failures."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    rec = StreamRecorder(
        RequestResult(spec.index, spec.kind, False, spec.prompt_len, spec.output_len, start_s=time.perf_counter())
    )
    try:
        async with client.stream(
            "POST",
            cfg.url_for(spec.index).rstrip("/") + path,
            json=request_body(cfg, spec),
            headers=headers,
            timeout=cfg.timeout_s,
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec.finish(time.perf_counter())
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    rec.feed(line[5:].strip(), time.perf_counter())
    except Exception as e:  # noqa: BLE001 - one malformed answer must fail that request, not the run
        rec.r.error = f"{type(e).__name__}: {e}"
    return rec.finish(time.perf_counter())


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id in ``GET /v1/models`` (``RuntimeError`` saying what failed otherwise)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(
            f"cannot read the model name from {base_url}/v1/models ({e}); pass --served-model-name"
        ) from None
