"""Roofline arithmetic of ``pdserve bench engine --roofline``: pure functions, no timing.

A decode step reads every matmul weight once (the tied embedding/output matrix once, as the LM head's matmul reads
it; the embedding gather reads only the batch's rows) plus each sequence's KV cache, and multiplies every weight by
each of its B rows: its floor is the larger of ``bytes / read bandwidth`` (small batches) and ``FLOPs / matmul
peak`` (large ones). A prefill is compute-bound: its floor is ``FLOPs / matmul peak``. ``fraction = bound /
measured`` (1.0 = at the roof). Activations, the logits written and read back by the sampler, and the KV written for
the new tokens are left out (under 1% at batch 1; about 5% at batch 32 with 100-token contexts, mostly the logits).

``OP_CLASSES`` sorts the profiler's op names into the classes of the per-step breakdown;
``breakdown`` turns ``(name, self time)`` rows and a wall time into shares.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 2}
# "int8" is the engine's --dtype bfloat16 --weight-dtype int8: bfloat16 activations, KV and norms
# (DTYPE_BYTES), matmul weights of one byte plus one float32 scale per output row
MATMUL_WEIGHT_BYTES = {"int8": 1}
SCALE_BYTES = 4

# class -> op names as torch.profiler reports them ("prefix*" matches a prefix). First match wins,
# in this order; unmatched ops go to OTHER. The C kernels (ctypes calls: attention, the bfloat16
# GEMV of small batches, the fused norm/rotary/SiLU ops) are no aten ops: the bench wraps each in a
# profiler range named below (without that their time would land in PYTHON, with the interpreter
# and batch building).
C_ATTENTION = "pdserve::paged_decode"
C_EXTEND = "pdserve::paged_extend"
C_GEMV = "pdserve::gemv_bf16"
C_GEMV_I8 = "pdserve::gemv_i8w"
C_PAIRS = "pdserve::gemm_pairs"
C_FUSED = "pdserve::fused"
C_STORE = "pdserve::store_kv"
# engine.decode_stack: a small decode step's layers in one C call (matmuls, attention, norms inside
# it are not told apart: they are one range)
C_STACK = "pdserve::decode_stack"
OP_CLASSES: dict[str, tuple[str, ...]] = {
    "C layer stack": (C_STACK,),
    "matmuls": (
        "aten::mm",
        "aten::addmm",
        "aten::linear",
        "aten::matmul",
        "aten::bmm",
        "aten::baddbmm",
        "mkldnn::_linear_pointwise",
        "aten::_mkl_linear",
        "aten::mkldnn_linear",
        C_GEMV,
        C_GEMV_I8,
        C_PAIRS,
    ),
    "attention": (
        C_ATTENTION,
        C_EXTEND,
        C_STORE,
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product*",
        "aten::softmax",
        "aten::_softmax",
        "aten::index_put_",
        "aten::_index_put_impl_",
        "aten::stack",
        "aten::index",
    ),  # KV store; the torch backend's page gather (also rope's small cos/sin lookup)
    "norms/rotary/act": (
        C_FUSED,
        "aten::rsqrt",
        "aten::pow",
        "aten::mean",
        "aten::mul",
        "aten::add",
        "aten::silu",
        "aten::cat",
        "aten::neg",
        "aten::sub",
        "aten::div",
    ),
    "logits+sampling": (
        "aten::argmax",
        "aten::topk",
        "aten::sort",
        "aten::log_softmax",
        "aten::_log_softmax",
        "aten::multinomial",
        "aten::exponential_",
        "aten::max",
        "aten::cumsum",
    ),
}
OTHER = "other ops"  # copies, indexing, padding, allocation: ops of no class above
PYTHON = "python+batch"  # wall time minus every op's self time
CLASSES = (*OP_CLASSES, OTHER, PYTHON)


@dataclass(frozen=True)
class Roof:
    """One roofline row: ``bound_s`` the floor, ``measured_s`` the time taken."""

    bound_s: float
    measured_s: float

    @property
    def fraction(self) -> float:
        """``bound / measured``: 1.0 means running at the roof."""
        return fraction(self.bound_s, self.measured_s)


def layer_matmul_shapes(cfg: ModelConfig, sparse: bool = False) -> list[tuple[int, int]]:
    """``(out, in)`` of one decoder layer's matmul weights: fused QKV, output projection, fused
    gate/up, down; a ``sparse`` (MoE) layer's router in place of the MLP (its experts apart:
    :func:`expert_params`)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    if sparse:
        return [(q + 2 * kv, h), (h, q), (cfg.moe.num_experts, h)]
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def _sparse(cfg: ModelConfig) -> list[bool]:
    """Whether each layer's MLP is an expert mixture."""
    return [cfg.moe is not None and i in cfg.moe.sparse_layers for i in range(cfg.num_layers)]


def layer_matmul_params(cfg: ModelConfig, sparse: bool = False) -> int:
    """Weights of one decoder layer's matmuls (a sparse layer: without its experts)."""
    return sum(out * inp for out, inp in layer_matmul_shapes(cfg, sparse))


def dense_matmul_params(cfg: ModelConfig) -> int:
    """Every layer matmul weight a step reads whatever the routing: all of them in a dense model; an
    MoE model's attention, routers and dense layers' MLPs (the experts apart)."""
    return sum(layer_matmul_params(cfg, s) for s in _sparse(cfg))


def expert_params(cfg: ModelConfig) -> int:
    """Weights of one expert (gate, up, down); 0 for a dense model."""
    return 0 if cfg.moe is None else 3 * cfg.hidden_size * cfg.moe.expert_size


def active_experts_bound(cfg: ModelConfig, batch: int) -> int:
    """The most experts a step of ``batch`` tokens reads over all sparse layers: per layer the union
    of the tokens' top-k, at most ``min(num_experts, top_k * batch)``."""
    if cfg.moe is None:
        return 0
    return len(cfg.moe.sparse_layers) * min(cfg.moe.num_experts, cfg.moe.top_k * batch)


def lm_head_params(cfg: ModelConfig) -> int:
    """Weights of the output matmul (the tied embedding matrix when tied)."""
    return cfg.vocab_size * cfg.hidden_size


def norm_params(cfg: ModelConfig) -> int:
    """RMSNorm weights: two per layer plus the final one (plus q/k norms when the model has them)."""
    qk = 2 * cfg.head_dim if cfg.qk_norm else 0
    return cfg.num_layers * (2 * cfg.hidden_size + qk) + cfg.hidden_size


def weight_bytes_per_step(cfg: ModelConfig, dtype: str, batch: int, active_experts: int | None = None) -> int:
    """Weight bytes one decode step of ``batch`` sequences reads: every matmul weight once, the norms,
    and ``batch`` rows of the embedding (a separate matrix's rows when untied, the LM head's when tied:
    counted once either way, as rows of a gather). An MoE model reads its dense weights and the
    experts the step's tokens chose, each once: ``active_experts`` in all over the sparse layers (the
    union of the tokens' choices per layer; None: :func:`active_experts_bound`). "int8": the matmul
    weights (experts too) at one byte each plus their per-row scales, the rest bfloat16."""
    experts = active_experts_bound(cfg, batch) if active_experts is None else active_experts
    matmul = dense_matmul_params(cfg) + lm_head_params(cfg) + experts * expert_params(cfg)
    rest = (norm_params(cfg) + batch * cfg.hidden_size) * DTYPE_BYTES[dtype]
    if dtype not in MATMUL_WEIGHT_BYTES:
        return matmul * DTYPE_BYTES[dtype] + rest
    rows = matmul_output_rows(cfg) + (0 if cfg.moe is None else experts * (2 * cfg.moe.expert_size + cfg.hidden_size))
    return matmul * MATMUL_WEIGHT_BYTES[dtype] + rows * SCALE_BYTES + rest


def matmul_output_rows(cfg: ModelConfig) -> int:
    """Output rows of every matmul weight of a step (one int8 scale each): the layers' and the head's."""
    return sum(out for s in _sparse(cfg) for out, _ in layer_matmul_shapes(cfg, s)) + cfg.vocab_size


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """KV cache bytes of one token over all layers: ``layers x 2 x kv_heads x head_dim x dtype``."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def decode_step_bytes(cfg: ModelConfig, dtype: str, contexts: Iterable[int]) -> int:
    """Bytes a decode step reads: weights once plus each sequence's KV over its context
    (``contexts``: one length per sequence of the batch)."""
    contexts = list(contexts)
    return weight_bytes_per_step(cfg, dtype, len(contexts)) + kv_bytes_per_token(cfg, dtype) * sum(contexts)


def token_matmul_params(cfg: ModelConfig) -> int:
    """Layer matmul weights one token multiplies by: the dense ones and its top-k experts per sparse
    layer."""
    topk = 0 if cfg.moe is None else cfg.moe.top_k * len(cfg.moe.sparse_layers)
    return dense_matmul_params(cfg) + topk * expert_params(cfg)


def prefill_flops(cfg: ModelConfig, tokens: int, logits_rows: int = 1) -> float:
    """FLOPs of a causal prefill of ``tokens`` tokens: ``2 x token matmul params x tokens``, the LM head
    on ``logits_rows`` rows (the engine computes logits for the last token only), and attention's
    ``QK^T`` and ``PV``: ``2 x 2 x layers x heads x head_dim x tokens^2 / 2``."""
    matmul = 2 * (token_matmul_params(cfg) * tokens + lm_head_params(cfg) * logits_rows)
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
    return float(matmul + attention)


def decode_step_flops(cfg: ModelConfig, contexts: Iterable[int]) -> float:
    """FLOPs of a decode step, one new token per sequence (``contexts``: one length per sequence):
    ``2 x (token matmul params + LM head) x B`` plus attention's ``QK^T`` and ``PV`` over each context,
    ``2 x 2 x layers x heads x head_dim x context``."""
    contexts = list(contexts)
    matmul = 2 * (token_matmul_params(cfg) + lm_head_params(cfg)) * len(contexts)
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * sum(contexts)
    return float(matmul + attention)


def decode_bound_s(nbytes: float, bandwidth: float, flops: float, peak: float) -> float:
    """A decode step's floor: the slower of reading ``nbytes`` at ``bandwidth`` and computing
    ``flops`` at the matmul ``peak`` (``peak`` 0: bandwidth only)."""
    return max(nbytes / bandwidth, flops / peak if peak > 0 else 0.0)


def bound_s(amount: float, rate: float) -> float:
    """The roofline floor: ``amount`` (bytes or FLOPs) at ``rate`` (per second)."""
    return amount / rate


def fraction(bound: float, measured: float) -> float:
    """``bound / measured`` (0 when nothing was measured)."""
    return bound / measured if measured > 0 else 0.0


def classify_op(name: str) -> str:
    """The breakdown class of profiler op ``name`` (``OTHER`` when no rule of ``OP_CLASSES`` matches)."""
    for cls, patterns in OP_CLASSES.items():
        for p in patterns:
            if name.startswith(p[:-1]) if p.endswith("*") else name == p:
                return cls
    return OTHER


def breakdown(rows: Iterable[tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Seconds per class of ``CLASSES`` from ``(op name, self CPU seconds)`` rows over ``wall_s``;
    ``PYTHON`` gets what the ops do not account for (never below 0)."""
    out = dict.fromkeys(CLASSES, 0.0)
    for name, self_s in rows:
        out[classify_op(name)] += self_s
    out[PYTHON] = max(0.0, wall_s - sum(out[c] for c in CLASSES if c != PYTHON))
    return out


def shares(seconds: dict[str, float]) -> dict[str, float]:
    """Each class's share of the total of ``seconds`` (0 when the total is 0)."""
    total = sum(seconds.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}
