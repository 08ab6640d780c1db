"""The router's scripted fake worker: a worker client double that answers heartbeats at once and
plays a scripted stream of tokens (or an error, a hang, silence) for each request, so the router's
HTTP layer runs without a model. ``make_client`` (tests/router/conftest.py) builds a router on one;
``completion`` and ``sse_events`` are the requests and the stream parsing its tests share."""

from __future__ import annotations

import asyncio

from server.router.registry import WorkerSpec
from server.router.worker_client import WorkerUnavailable
from transfer.wire.protocol import TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams

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
        self.on_stats(
            self.spec.worker_id,
            WorkerStats(
                nonce=nonce,
                worker_id=self.spec.worker_id,
                role="colocated",
                model="fake-model",
                capacity_tokens=CAPACITY,
                max_model_len=CONTEXT,
                page_size=16,
                gauges={"kv_pages_used": 0.0},
            ),
        )

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
        pieces = self.mode.get("pieces", PIECES)  # the text to play, one token per step
        ids = [t for p in pieces for t in self.tok.encode(p)][: params.max_new_tokens]
        eos = self.mode.get("eos")  # end on this stop token (as a worker does) instead of a text token
        for i, t in enumerate(ids):
            await asyncio.sleep(0.001)
            if rid in self.aborted:
                return
            last = i == len(ids) - 1 and eos is None
            finish = ("stop" if len(ids) < params.max_new_tokens else "length") if last else None
            lp = self.mode["logprob"](params) if "logprob" in self.mode else -0.5  # per-request logprob if scripted
            top = [(t, lp), (t + 1, lp - 1.0)][: params.logprobs] if params.logprobs is not None else None
            delta = TokenDelta(
                rid=rid, token_ids=[t], logprobs=[lp], top_logprobs=[top], finish_reason=finish, prompt_tokens=n_prompt
            )
            if i == 0 and params.prompt_logprobs is not None:  # token j scores -j, ranks j + 1, top: id 7
                delta.prompt_logprobs = [None] + [
                    (-float(j), [(7, -0.1)][: params.prompt_logprobs], j + 1) for j in range(1, n_prompt)
                ]
            self.on_tokens(self.spec.worker_id, delta)
        if eos is not None:
            self.on_tokens(
                self.spec.worker_id,
                TokenDelta(
                    rid=rid,
                    finish_reason="stop",
                    prompt_tokens=n_prompt,
                    stop_token_id=eos,
                    stop_logprob=-0.25,
                    stop_top_logprobs=[(eos, -0.25)],
                ),
            )


def completion(client, headers=None, **body):
    return client.post(
        "/v1/completions", json={"prompt": "The capital of France", "max_tokens": 16, **body}, headers=headers or {}
    )


def sse_events(text: str) -> list:
    return [ln.removeprefix("data: ") for ln in text.split("\n\n") if ln.startswith("data: ")]
