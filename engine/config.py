"""Model architecture description shared by loaders, the model and the KV pools."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.rope_scaling import RopeScaling
from engine.swa_config import SlidingSpec, finalize, unsupported_arch_message

# "ministral" (transformers' MinistralForCausalLM) has Llama's weight names plus per-layer
# sliding windows; mistral is Llama with one window for every layer.
SUPPORTED_ARCHS = (
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "llama",
    "ministral",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "smollm",
)
# Served from HF folders only: phi3's GGUF layout (fused attn_qkv / ffn_up, rope.dimension_count) and
# gemma2's (its soft-capping and norms under llama.cpp names) and the MoE layouts are not read;
# gemma3_text is Gemma 3's HF model type (its GGUF files are "gemma3", engine.gguf_gemma3).
HF_ONLY_ARCHS = ("gemma2", "gemma3_text", "gpt_oss", "mixtral", "phi3", "qwen2_moe", "qwen3_moe")
MODEL_ARCHS = (*SUPPORTED_ARCHS, "gemma3")  # gemma3: engine/gemma3.py, from GGUF only (engine/gguf_gemma3.py)


@dataclass(frozen=True)
class MoeSpec:
    """The MoE settings of a model. ``sparse_layers`` are the layer indices whose MLP is the expert
    mixture (the others keep the dense MLP of ``intermediate_size``); ``1 <= top_k <= num_experts``.
    ``shared_expert_size`` > 0: each sparse layer also runs a shared SwiGLU expert of that size on every
    token, added to the mixture scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE); 0: none."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size (moe_intermediate_size / intermediate_size)
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0
    swiglu: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.shared_expert_size < 0:
            raise ValueError(f"shared_expert_intermediate_size {self.shared_expert_size} must be at least 0")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim * num_heads`` need not equal
    ``hidden_size`` (Qwen3 decouples them); ``rotary_dim`` is even and ``<= head_dim``.
    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``; ``sliding_window`` is set
    iff some layer slides (a window given with no sliding layer is dropped; a sliding layer without
    a window is a ``ValueError``).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (engine.rope_scaling)
    # dims of each head that rotate (the first ``rotary_dim``; transformers' partial_rotary_factor);
    # 0 means all of them (set to ``head_dim``)
    rotary_dim: int = 0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # an o_proj bias beside the q/k/v ones (gpt-oss's attention_bias)
    o_bias: bool = False
    # one learned logit per query head in each softmax's denominator, attending to no value (gpt-oss's
    # ``sinks``); only the torch attention paths compute it (engine.attention)
    attention_sinks: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())
    name: str = "model"
    # how the checkpoint stores its weights: float32, bfloat16, float16 or quantized (a GGUF
    # quantization); ``--dtype auto`` follows it (engine.dtype_choice)
    stored_dtype: str = "float32"
    # the expert mixture of the sparse layers (engine.moe); None: every layer's MLP is dense
    moe: MoeSpec | None = None

    def __post_init__(self) -> None:
        if self.arch not in MODEL_ARCHS:
            raise ValueError(unsupported_arch_message(self.arch, MODEL_ARCHS))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 1..head_dim ({self.head_dim})")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, expected {self.num_layers}")
        bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"unknown layer_types {bad}: each must be 'full_attention' or 'sliding_attention'")
        if self.moe is not None and not set(self.moe.sparse_layers) <= set(range(self.num_layers)):
            raise ValueError(f"MoE sparse layers {self.moe.sparse_layers} outside 0..{self.num_layers - 1}")
        spec = finalize(SlidingSpec(self.sliding_window, tuple(self.layer_types)))
        object.__setattr__(self, "sliding_window", spec.window)
        object.__setattr__(self, "layer_types", spec.layer_types)
