"""Everything a router app needs, passed explicitly (no module-level state)."""

from __future__ import annotations

from dataclasses import dataclass

from configs.schema import PdserveConfig
from engine.tokenizer import Tokenizer
from server.router.admission import Admission
from server.router.inflight import InflightTable
from server.router.kv_subscriber import KvSubscriber
from server.router.metrics import RouterMetrics
from server.router.registry import Registry


@dataclass
class RouterContext:
    """The router's config, tokenizer, served model name, workers, in-flight table, metrics and
    admission stage; with cache-aware routing, the subscriber to the workers' KV event feeds."""

    cfg: PdserveConfig
    tokenizer: Tokenizer
    model_name: str
    registry: Registry
    table: InflightTable
    metrics: RouterMetrics
    admission: Admission
    kv_subscriber: KvSubscriber | None = None
