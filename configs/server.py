"""Router / HTTP server settings."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address (loopback unless you mean otherwise)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer KEY' (env PDSERVE_API_KEY)")
    served_model_name: str | None = Field(None, description="model name in the API; default: the model file's stem")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="largest accepted request body")
    request_timeout_s: float = Field(600.0, gt=0, description="abort a request that runs longer than this")
    health_interval_s: float = Field(1.0, gt=0, description="worker heartbeat period")
    worker_timeout_s: float = Field(10.0, gt=0, description="a worker silent this long is dead")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
