"""Router / HTTP server settings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from configs.api_keys import parse_api_keys


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address (loopback unless you mean otherwise)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(
        None,
        description="require 'Authorization: Bearer KEY' (env PDSERVE_API_KEY); "
        "several keys: KEY[:SHARE],KEY[:SHARE]... each with a share of the "
        "router's forwarding slots under overload (default share 1)",
    )
    served_model_name: str | None = Field(None, description="model name in the API; default: the model file's stem")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="largest accepted request body")
    route_decode: str | None = Field(
        None,
        description="pd mode: send every new request to this decode worker (its id, e.g. decode-0) while it is "
        "ready: a skewed load for tests and benchmarks of migration (--migrate-after); it wins "
        "over --routing",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="abort a request that runs longer than this")
    max_queued_requests: int = Field(
        512,
        ge=0,
        description="admission: requests waiting in the router's queue beyond this are refused with 429 "
        "(the lowest priority first); 0 = never queue (429 whenever the workers are full)",
    )
    max_queued_tokens: int | None = Field(
        None,
        ge=1,
        description="admission: refuse with 429 when the queued requests' prompt + max_tokens would "
        "exceed this (None = no token bound)",
    )
    max_queue_wait_s: float | None = Field(
        None,
        gt=0,
        description="admission: refuse with 429 a request whose estimated wait in the router's "
        "queue (queued work ahead / measured drain rate) exceeds this (None = off)",
    )
    max_inflight_per_worker: int | None = Field(
        None,
        ge=1,
        description="admission: requests this router keeps in flight per ready decode (or "
        "colocated) worker before queueing the rest itself, where priorities and key "
        "shares apply (None = max_running_requests + max(2, max_running_requests // 8))",
    )
    fair_headroom_per_worker: int | None = Field(
        None,
        ge=0,
        description="admission: forwarding slots per ready worker that a key already holding its share "
        "leaves free while other API keys are active, so their next request starts at "
        "once (None = the forwarding margin beyond the batch + 1, i.e. one free place in "
        "each worker's batch; 0 = off)",
    )
    fair_preemption: bool = Field(
        True,
        description="admission, PD mode: while two or more API keys are active, a request that leaves its "
        "key below another (slots held or work granted lately, per share) is forwarded even when every "
        "forwarding slot is taken, and a decode worker whose batch is full retracts (offloads) a running "
        "request without that mark to start it at once; the retracted one resumes when a place frees "
        "(False = it waits for a place)",
    )
    planner: Literal["off", "slo"] = Field(
        "off",
        description="pd mode: 'slo' lets the router switch workers between prefill and decode by load: a "
        "decode worker becomes a prefill worker while the predicted TTFT is over --slo-ttft-ms and TPOT "
        "has headroom, and the reverse (docs/design/planner.md)",
    )
    slo_ttft_ms: float | None = Field(None, gt=0, description="planner: the time-to-first-token SLO (ms)")
    slo_tpot_ms: float | None = Field(None, gt=0, description="planner: the time-per-output-token SLO (ms)")
    planner_interval_s: float = Field(5.0, gt=0, description="planner: seconds between evaluations")
    planner_hysteresis: int = Field(
        3, ge=1, description="planner: evaluations in a row an SLO must be predicted violated before a move"
    )
    planner_dwell_s: float = Field(
        60.0, ge=0, description="planner: seconds after any move (made or refused) before the next one"
    )
    planner_headroom: float = Field(
        0.8,
        gt=0,
        le=1,
        description="planner: a move is made only if the other SLO's metric, predicted after it, stays "
        "within this fraction of that SLO",
    )
    planner_cores: Literal["auto", "shared", "own"] = Field(
        "auto",
        description="planner: whether a move adds compute to the role it joins: shared (the workers share "
        "one host's cores: no move is made for a TTFT or TPOT violation), own (each worker has its own "
        "cores, as nodes), auto (shared when this launch runs its workers lending each other cores)",
    )
    health_interval_s: float = Field(1.0, gt=0, description="worker heartbeat period")
    worker_timeout_s: float = Field(10.0, gt=0, description="a worker silent this long is dead")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level of the router and workers"
    )

    @field_validator("api_key")
    @classmethod
    def _keys_parse(cls, v: str | None) -> str | None:
        parse_api_keys(v)  # raises ValueError saying what to change
        return v

    @model_validator(mode="after")
    def _planner_slos(self) -> ServerConfig:
        if self.planner == "slo" and (self.slo_ttft_ms is None or self.slo_tpot_ms is None):
            raise ValueError("planner 'slo' needs both SLOs: add --slo-ttft-ms and --slo-tpot-ms")
        return self
