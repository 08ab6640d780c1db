"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral; gpt-oss's experts apart, at the end) on the torch path.

A sparse layer's MLP is a router (``[num_experts, hidden]``) and ``num_experts`` SwiGLU experts held
stacked: ``gate_up[e]`` ``[2 * inter, hidden]`` (gate rows first) and ``down[e]`` ``[hidden, inter]``.
Each token goes to its ``top_k`` experts by the router's softmax (in float32, as transformers), the
top-k probabilities renormalized to sum 1 where ``norm_topk_prob`` (Mixtral always does), and its
output is the weighted sum of those experts' outputs. Qwen2-MoE adds a shared expert: a dense SwiGLU
MLP every token runs, scaled by ``sigmoid(shared_expert_gate(x))`` (one logit per token) and added to
the mixture (:func:`shared_expert`; the model packs its matmuls as the dense MLP's).

The step's tokens are grouped by expert: every expert that some token picked runs one gate/up and one
down matmul over all of its tokens, so each expert's weights are read once per step whatever the batch
(not once per token), and the weighted outputs are scatter-added back to their tokens. On CPU the C
expert kernel (``engine.kernels.cpu_moe``) runs all of that: a decode-sized step in one call, a
prefill chunk in one call per ``LARGE_STEP_ROWS`` tokens. On CUDA the grouping runs as two fused
Triton grouped GEMMs (``engine.kernels.triton_moe``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import MoeSpec
from engine.kernels import cpu_moe, fused, triton_moe


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` of each row of ``x``: ``[rows, top_k]`` each, the experts in decreasing
    router probability, the weights in ``x.dtype`` (softmax and renormalization in float32)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


# Steps of at most this many tokens take the C expert kernel on CPU in one call (the decode stack's
# row limit on MoE models too); 0 turns the kernel off.
KERNEL_MAX_ROWS = 64
# Layers whose experts were laid out at load (``gemm_layout``) run every kernel call by the
# register-blocked expert GEMM (``cpu_moe.expert_gemm``): it ran 1.9-2.3x faster than the dot-product
# kernel at every size timed, 1 to 128 tokens, one thread, and ~1.5x at 512
# (``python -m benchmarks.moe_prefill``), and such layers hold no row-major experts for that kernel.
# Larger steps (prefill chunks, mixed batches) take it in chunks of this many tokens, each chunk's
# chosen experts' weights read once; 0 keeps the torch matmuls for them. Why: the torch loop's
# per-expert matmuls ran 4-5x slower than the kernel at 256 and 2048 tokens, bfloat16 and float32,
# and ~13x inside a served step, where oneDNN builds a primitive for every new per-expert row count
# (``python -m benchmarks.moe_prefill``). Chunks of 64 lost half the gain; 256, 512 and one call per
# step were alike at 2048 tokens, so 512 (the CPU prefill chunk) bounds the scratch (pairs x inter).
LARGE_STEP_ROWS = 512


def moe_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], spec: MoeSpec, kernel: bool = True) -> torch.Tensor:
    """The expert mixture of ``x`` ``[rows, hidden]`` with one layer's tensors ``w`` (``router``, and the
    experts as ``experts_gate_up`` / ``experts_down`` or, laid out at load, ``experts_*_pairs``); returns
    ``[rows, hidden]`` in ``x.dtype``. On CUDA with triton importable and ``kernel``, the fused Triton
    kernels run it (``engine.kernels.triton_moe``, any number of rows). On CPU, where it takes the
    tensors and ``kernel``, ``engine.kernels.cpu_moe`` runs it (sums of all experts in float32, rounded
    once): one call for a step of at most ``KERNEL_MAX_ROWS`` rows, else one per ``LARGE_STEP_ROWS``
    consecutive rows (routed once for the whole step, every row in exactly one chunk), each call by the
    expert GEMM where the layer is laid out, else by the dot-product kernel; otherwise torch matmuls per
    expert (a laid-out layer's experts rebuilt from their panels one at a time)."""
    weights, experts = route(x, w["router"], spec.top_k, spec.norm_topk_prob)
    scales = (w["experts_gate_up_scale"], w["experts_down_scale"]) if "experts_down_scale" in w else None
    pairs = laid_out(w)
    gate_up, down = pairs or (w["experts_gate_up"], w["experts_down"])
    if kernel and pairs is None and triton_moe.takes(x, gate_up, down, scales):
        return triton_moe.fused_moe(x, gate_up, down, weights, experts, scales)
    rows = x.shape[0]
    chunk = 0 if not rows or not KERNEL_MAX_ROWS else rows if rows <= KERNEL_MAX_ROWS else LARGE_STEP_ROWS
    takes = cpu_moe.pairs_take if pairs is not None else cpu_moe.takes
    if kernel and chunk and takes(x, gate_up, down):
        parts = [
            _kernel_experts(
                x[r : r + chunk], weights[r : r + chunk], experts[r : r + chunk], (gate_up, down), scales, pairs
            )
            for r in range(0, rows, chunk)
        ]
        if all(p is not None for p in parts):
            return parts[0] if len(parts) == 1 else torch.cat(parts)
    counts, tokens, pair_weights = _group(weights, experts, spec.num_experts)
    return _torch_experts(x, gate_up, down, scales, counts.tolist(), tokens, pair_weights.unsqueeze(-1))


def shared_expert(x: torch.Tensor, w: dict[str, torch.Tensor], linear) -> torch.Tensor:
    """The gated shared expert of ``x`` ``[rows, hidden]`` as transformers' ``Qwen2MoeSparseMoeBlock``
    computes it: ``sigmoid(x @ shared_gate.T) * down(silu(gate(x)) * up(x))``, with the layer's packed
    ``shared_gate_up`` / ``shared_down`` run by ``linear`` (``engine.cpu_linear.linear``) and the
    ``shared_gate`` row ``[1, hidden]`` a plain tensor; returns ``[rows, hidden]`` in ``x.dtype``."""
    y = linear(fused.silu_mul(linear(x, w["shared_gate_up"])), w["shared_down"])
    return torch.sigmoid(F.linear(x, w["shared_gate"])) * y


def laid_out(w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(experts_gate_up_pairs, experts_down_pairs)`` of a layer whose experts were laid out at load
    (``gemm_layout``; it then holds no row-major experts), else None."""
    return (w["experts_gate_up_pairs"], w["experts_down_pairs"]) if "experts_down_pairs" in w else None


def experts_dtype(w: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype the layer ``w`` holds its experts in, laid out or not."""
    pairs = laid_out(w)
    return (pairs[1] if pairs is not None else w["experts_down"]).dtype


def row_major(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``w`` with row-major ``experts_gate_up`` / ``experts_down`` in place of laid-out panels (a new dict,
    the experts new tensors: twice the experts' bytes while both live); ``w`` itself where not laid out.
    For what times or checks the dot-product kernel beside the expert GEMM."""
    pairs = laid_out(w)
    if pairs is None:
        return w
    rest = {n: t for n, t in w.items() if not n.endswith("_pairs")}
    return rest | {"experts_gate_up": cpu_moe.from_pairs(pairs[0]), "experts_down": cpu_moe.from_pairs(pairs[1])}


def _group(weights: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """``(counts [num_experts], tokens, pair weights)``: the (token, slot) pairs of a routing grouped by
    expert (stable: tokens in increasing order within an expert), ``counts[e]`` pairs for expert ``e``."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    return torch.bincount(flat, minlength=num_experts), order // experts.shape[1], weights.flatten()[order]


def _kernel_experts(x, weights, experts, stacked, scales, pairs) -> torch.Tensor | None:
    """One C kernel call over rows ``x`` routed to ``(weights, experts)``, in ``x.dtype``: the expert GEMM
    where ``pairs`` (``stacked`` then is those panels), else ``cpu_moe.expert_ffn`` on ``stacked``
    (gate/up, down row-major); None where the kernel refuses."""
    gate_up, down = stacked
    counts, tokens, pair_weights = _group(weights, experts, gate_up.shape[0])
    chosen = counts.nonzero().flatten()
    offsets = F.pad(counts[chosen].cumsum(0), (1, 0))
    if pairs is not None:
        out = cpu_moe.expert_gemm(x, stacked, chosen, offsets, tokens, pair_weights.float(), scales=scales)
    else:
        out = cpu_moe.expert_ffn(x, gate_up, down, chosen, offsets, tokens, pair_weights.float(), scales=scales)
    return None if out is None else out.to(x.dtype)


def _expert(t: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s row-major matrix of stacked ``t`` in ``dtype`` (int8 ``t`` dequantized by its row
    scales); ``t`` laid out by ``cpu_moe.to_pairs``: that expert rebuilt from its panels (a copy)."""
    m = cpu_moe.from_pairs(t[e : e + 1])[0] if t.dim() == 6 else t[e]
    return m if scale is None else (m.float() * scale[e][:, None]).to(dtype)


def _torch_experts(x, gate_up, down, scales, counts: list[int], tokens, pair_weights) -> torch.Tensor:
    """The torch path of :func:`moe_mlp`: per expert with tokens, one gate/up and one down matmul over
    them, the weighted outputs scatter-added (rounded to ``x.dtype`` at each step)."""
    gs, ds = scales or (None, None)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = tokens[start : start + n]
        g, u = F.linear(x[rows], _expert(gate_up, gs, e, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, _expert(down, ds, e, x.dtype))
        out.index_add_(0, rows, y * pair_weights[start : start + n])
        start += n
    return out


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 of stacked experts ``t`` ``[E, out, in]`` by ``engine.weight_layout.quantize_int8``'s
    scheme: per output row scale = max |row| / 127 (1 for an all-zero row), q = round(t / scale);
    every element within scale / 2 of ``t``. Returns ``(q int8, scale float32 [E, out])``. The float32
    math runs one expert at a time: the transient is one expert's weights in float32, not the layer's."""
    q = torch.empty(t.shape, dtype=torch.int8, device=t.device)
    scale = torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device)
    tiny = torch.finfo(torch.float32).tiny
    for e in range(t.shape[0]):
        tf = t[e].float()
        absmax = tf.abs().amax(dim=-1)
        scale[e] = torch.where(absmax > 0, (absmax / 127).clamp_min(tiny), torch.ones_like(absmax))
        q[e] = torch.round(tf / scale[e, :, None]).clamp(-127, 127)
    return q, scale


def load_experts(get, prefix: str, spec: MoeSpec, int8: bool = False) -> dict[str, torch.Tensor]:
    """One sparse layer's tensors from the checkpoint getter ``get`` (``engine.model.checkpoint_getter``)
    under ``prefix`` (``model.layers.{i}.mlp.``), HF per-expert names stacked for :func:`moe_mlp`;
    ``int8``: the experts weight-only int8 (:func:`quantize_rows`) with ``experts_*_scale`` beside them."""
    experts = range(spec.num_experts)
    w = {
        "router": get(prefix + "gate.weight"),
        "experts_gate_up": _stacked(get, prefix, experts, ("gate_proj", "up_proj")),
        "experts_down": _stacked(get, prefix, experts, ("down_proj",)),
    }
    if int8:
        for name in ("experts_gate_up", "experts_down"):
            w[name], w[name + "_scale"] = quantize_rows(w[name])
    if _lays_out(w["experts_gate_up"], w["experts_down"]):
        # one copy of the experts: the panels serve every consumer (``laid_out``); one tensor at a time,
        # so the load holds at most one of them twice
        for name in ("experts_gate_up", "experts_down"):
            w[name + "_pairs"] = cpu_moe.to_pairs(w.pop(name))
    return w


def _stacked(get, prefix: str, experts: range, parts: tuple[str, ...]) -> torch.Tensor:
    """``[E, rows, in]``: each expert's ``parts`` matrices concatenated by rows, copied straight into one
    tensor (no per-expert intermediate); each checkpoint tensor is taken from ``get`` once."""
    first = [get(f"{prefix}experts.{experts[0]}.{p}.weight") for p in parts]
    rows, cols = sum(t.shape[0] for t in first), first[0].shape[1]
    out = torch.empty(len(experts), rows, cols, dtype=first[0].dtype, device=first[0].device)
    for i, e in enumerate(experts):
        row = 0
        for j, p in enumerate(parts):
            t = first[j] if i == 0 else get(f"{prefix}experts.{e}.{p}.weight")
            out[e, row : row + t.shape[0]].copy_(t)
            row += t.shape[0]
        if i == 0:
            first = []
    return out


def gemm_layout(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """``experts_gate_up_pairs`` and ``experts_down_pairs``, the stacked experts in the expert GEMM's
    pair-panel layout (``cpu_moe.to_pairs``), where that kernel runs them: CPU tensors, bfloat16 or int8,
    sizes multiples of 64, a CPU with AVX512-BF16; else nothing. Prepared once at load, where they
    replace the row-major experts (:func:`load_experts`), so a layer holds one copy of its experts: the
    expert GEMM reads the panels (per layer and in the decode stack) and the torch path rebuilds one
    expert at a time from them."""
    if not _lays_out(gate_up, down):
        return {}
    return {"experts_gate_up_pairs": cpu_moe.to_pairs(gate_up), "experts_down_pairs": cpu_moe.to_pairs(down)}


def _lays_out(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """True iff :func:`gemm_layout` lays these row-major stacked experts out (see there)."""
    probe = torch.empty(1, gate_up.shape[-1], dtype=torch.bfloat16)
    return gate_up.device.type == "cpu" and cpu_moe.gemm_takes(probe, gate_up, down)


def expert_shapes(hidden: int, spec: MoeSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of one sparse layer under ``prefix`` with their shapes."""
    if spec.swiglu is not None:
        return gpt_oss_expert_shapes(hidden, spec, prefix)
    shapes: dict[str, tuple[int, ...]] = {prefix + "gate.weight": (spec.num_experts, hidden)}
    for e in range(spec.num_experts):
        p = f"{prefix}experts.{e}."
        shapes |= {
            p + "gate_proj.weight": (spec.expert_size, hidden),
            p + "up_proj.weight": (spec.expert_size, hidden),
            p + "down_proj.weight": (hidden, spec.expert_size),
        }
    if spec.shared_expert_size:
        p, size = prefix + "shared_expert.", spec.shared_expert_size
        shapes |= {
            p + "gate_proj.weight": (size, hidden),
            p + "up_proj.weight": (size, hidden),
            p + "down_proj.weight": (hidden, size),
            prefix + "shared_expert_gate.weight": (1, hidden),
        }
    return shapes


# Qwen3MoeConfig's and Qwen2MoeConfig's defaults: (num_experts, num_experts_per_tok, moe_intermediate_size).
_QWEN_MOE_DEFAULTS = {"qwen3_moe": (128, 8, 768), "qwen2_moe": (60, 4, 1408)}
# Qwen2MoeConfig's shared_expert_intermediate_size default (Qwen3-MoE has no shared expert).
_QWEN2_MOE_SHARED = 5632


# GptOssConfig's defaults: (num_local_experts, num_experts_per_tok, swiglu_alpha, swiglu_limit).
_GPT_OSS_DEFAULTS = (128, 4, 1.702, 7.0)


def hf_moe_spec(cfg: dict, num_layers: int, arch: str = "qwen3_moe") -> MoeSpec | None:
    """The :class:`MoeSpec` of a ``config.json`` of model type ``arch``. Mixtral: every layer sparse,
    ``num_local_experts`` (default 8) experts of ``intermediate_size``, top ``num_experts_per_tok``
    (default 2), always renormalized. Qwen3-MoE (defaults 128 experts, top 8, expert size 768) and
    Qwen2-MoE (60, top 4, 1408, and a shared expert of ``shared_expert_intermediate_size``, default 5632),
    with their config classes' defaults of no renormalization and every layer sparse: layer ``i`` is
    sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``; ``None`` when no
    layer is (``num_experts`` 0). ``ValueError`` for a step below 1 or a non-boolean ``norm_topk_prob``."""
    if arch == "gpt_oss":
        return _gpt_oss_spec(cfg, num_layers)
    if arch == "mixtral":
        experts, top_k = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
        return MoeSpec(experts, top_k, int(cfg["intermediate_size"]), True, tuple(range(num_layers)))
    default_experts, default_top_k, default_size = _QWEN_MOE_DEFAULTS[arch]
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", default_experts)))
    step = int(cfg.get("decoder_sparse_step", 1))
    norm = cfg.get("norm_topk_prob", False)
    if step < 1:
        raise ValueError(f"config.json field decoder_sparse_step={step} must be at least 1")
    if not isinstance(norm, bool):
        raise ValueError(f"config.json field norm_topk_prob={norm!r} must be true or false")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    sparse = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    if not sparse:
        return None
    top_k = int(cfg.get("num_experts_per_tok", default_top_k))
    size = int(cfg.get("moe_intermediate_size", default_size))
    shared = int(cfg.get("shared_expert_intermediate_size", _QWEN2_MOE_SHARED)) if arch == "qwen2_moe" else 0
    return MoeSpec(experts, top_k, size, norm, sparse, shared)


# Mixtral's checkpoint names (``block_sparse_moe``; w1 gate, w3 up, w2 down) -> the names above.
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def mixtral_name(name: str) -> str:
    """``name`` of a Mixtral checkpoint under the Qwen3-MoE names :func:`load_experts` reads; other
    names unchanged (``model.layers.0.block_sparse_moe.experts.3.w1.weight`` ->
    ``model.layers.0.mlp.experts.3.gate_proj.weight``)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    head, _, last = name.removesuffix(".weight").rpartition(".")
    return f"{head}.{_MIXTRAL_NAMES[last]}.weight" if ".experts." in name and last in _MIXTRAL_NAMES else name


# ----------------------------------------------------------------------------- gpt-oss experts


def _gpt_oss_spec(cfg: dict, num_layers: int) -> MoeSpec:
    """gpt-oss: every layer sparse, ``num_local_experts`` (or ``num_experts``) experts of
    ``intermediate_size``, top ``num_experts_per_tok``, the clamped SwiGLU's ``(swiglu_alpha,
    swiglu_limit)``, with GptOssConfig's defaults."""
    d_experts, d_top_k, d_alpha, d_limit = _GPT_OSS_DEFAULTS
    experts = int(cfg.get("num_local_experts", cfg.get("num_experts", d_experts)))
    swiglu = (float(cfg.get("swiglu_alpha", d_alpha)), float(cfg.get("swiglu_limit", d_limit)))
    top_k = int(cfg.get("num_experts_per_tok", d_top_k))
    return MoeSpec(experts, top_k, int(cfg["intermediate_size"]), False, tuple(range(num_layers)), swiglu=swiglu)


def gpt_oss_expert_shapes(hidden: int, spec: MoeSpec, prefix: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's checkpoint tensors of one layer's MLP under ``prefix`` (``model.layers.{i}.mlp.``): the
    router with its bias and the experts stacked as transformers' ``GptOssExperts`` holds them, ``x @ W``
    (``gate_up_proj`` ``[E, hidden, 2 * inter]`` with gate and up columns interleaved, gate first)."""
    e, inter = spec.num_experts, spec.expert_size
    return {
        prefix + "router.weight": (e, hidden),
        prefix + "router.bias": (e,),
        prefix + "experts.gate_up_proj": (e, hidden, 2 * inter),
        prefix + "experts.gate_up_proj_bias": (e, 2 * inter),
        prefix + "experts.down_proj": (e, inter, hidden),
        prefix + "experts.down_proj_bias": (e, hidden),
    }


def load_gpt_oss_experts(get, prefix: str) -> dict[str, torch.Tensor]:
    """One gpt-oss layer's MLP tensors from the checkpoint getter ``get`` under ``prefix``, in the
    checkpoint's layout (what :func:`gpt_oss_mlp` reads)."""
    names = {
        "router": "router.weight",
        "router_bias": "router.bias",
        "oss_gate_up": "experts.gate_up_proj",
        "oss_gate_up_bias": "experts.gate_up_proj_bias",
        "oss_down": "experts.down_proj",
        "oss_down_bias": "experts.down_proj_bias",
    }
    return {key: get(prefix + name) for key, name in names.items()}


def gpt_oss_route(x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` ``[rows, top_k]`` each as transformers' ``GptOssTopKRouter``: the top-k of
    ``x @ router.T + router_bias``, their softmax (in ``x.dtype``) the weights."""
    logits = F.linear(x, w["router"], w["router_bias"])
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of interleaved ``gate_up`` ``[..., 2 * inter]`` (gate at even columns, up at
    odd): ``g * sigmoid(alpha * g) * (u + 1)`` with ``g`` clamped to at most ``limit`` and ``u`` to
    ``[-limit, limit]``; returns ``[..., inter]``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], spec: MoeSpec) -> torch.Tensor:
    """gpt-oss's expert mixture of ``x`` ``[rows, hidden]`` (torch matmuls on any device, the tensors of
    :func:`load_gpt_oss_experts`) as transformers' ``GptOssMLP`` computes it: per expert some row
    chose, ``x @ gate_up[e] + b``, :func:`clamped_swiglu`, ``@ down[e] + b``, weighted and added back to
    its rows. Returns ``[rows, hidden]`` in ``x.dtype``."""
    alpha, limit = spec.swiglu
    weights, experts = gpt_oss_route(x, w, spec.top_k)
    counts, tokens, pair_weights = _group(weights, experts, spec.num_experts)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not n:
            continue
        rows = tokens[start : start + n]
        gate_up = x[rows] @ w["oss_gate_up"][e] + w["oss_gate_up_bias"][e]
        y = clamped_swiglu(gate_up, alpha, limit) @ w["oss_down"][e] + w["oss_down_bias"][e]
        out.index_add_(0, rows, (y * pair_weights[start : start + n, None]).to(x.dtype))
        start += n
    return out
