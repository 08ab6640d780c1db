"""A small decode step's transformer layers as one C call (``engine/kernels/cpu_decode_stack.c``).

Why: a decode step of 1-8 rows runs ~12 kernels per layer, each a few microseconds, and the Python
around each (the wrapper's checks, a new output tensor, the ctypes call) costs about as much again,
so at batch 1 the calls' overhead is a large share of the step (``pdserve bench engine --roofline``
profiles a decode step by op class). The stack runs the same kernels in the same order from C, with
scratch rows that stay in cache: one Python call per step.

Its row limit is the matmul kernels' (``cpu_linear.small_rows``): up to 64 where every weight is in
the pair-panel layout (``cpu_gemm_pairs.c``), so a busy server's 32-row decode steps run as one call
too; any decode step where those weights are held only as pairs (``cpu_linear.pairs_take_all``).

float32 models too: their layer weights are held as ``cpu_gemm_pairs.c``'s float32 panels
(``cpu_linear.to_panels_f32``), which serve the Python path's calls as well, so the two paths agree
to the bit.

Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): a sparse layer's MLP is the expert block,
run in C as ``engine.moe.moe_mlp`` runs it (router, softmax, top-k, the ``norm_topk_prob``
renormalization, the weights rounded to the model dtype, the pairs grouped by expert, ``cpu_moe.c`` on
them), then Qwen2-MoE's shared expert as ``engine.moe.shared_expert`` computes it (its packed matmuls
by the dense MLP's kernels, ``sigmoid(x . shared_gate)`` per row); Qwen3's per-head Q/K norms run there
too. Those steps are not bitwise the per-layer path: the router logits
and the Q/K norms sum in another order than torch's (float32 logits agree to ~1e-6; bfloat16 within a
rounding; tests/engine/test_decode_stack_moe.py).

Gemma 2 and Gemma 3 text (``engine.gemma3.Gemma3Model``): ``gemma_layer`` in C runs the block as
``Gemma3Layer.forward`` does, by the kernels it calls: the four norms and Gemma 3's Q/K norms by
``fused.rms_norm_f32w`` (float32 ``1 + weight`` scales, ``Gemma3Layer.scales``), the GELU-tanh MLP by
``fused.gelu_tanh_mul``, each residual add rounded as torch's; the sliding layers rotate with the local
tables. Attention, for every model: each layer reads its own (pool, window) view of the step
(``CpuBackend.pool_decode``: the full pool, or a hybrid's SWA pool, and a sliding layer's last ``window``
keys), with the backend's scale and attention-logit soft cap (Gemma 2: ``cap * tanh(s / cap)``). The
final norm, the LM head and Gemma 2's final-logit cap run after the stack, as on the layer path. So a
Gemma step is bitwise the per-layer path's (tests/engine/test_decode_stack_gemma.py, windows bound, the
SWA pool and one pool: float32 wherever the kernels build, on the portable float32 panels without
AVX-512F; bfloat16 where the small-batch kernels are).

Contract: ``DecodeStack.build(model)`` returns None where the model cannot take it (not a bfloat16 or
float32 CPU Llama-family or Gemma 2 / 3 model whose every attention, dense-MLP and shared-expert
matmul runs the small-batch kernel, a sparse layer whose experts ``cpu_moe.takes`` refuses or
``engine.moe.KERNEL_MAX_ROWS`` 0, no kernel library, or ``PDSERVE_DECODE_STACK=0``); its ``max_rows`` is
at most ``KERNEL_MAX_ROWS`` on MoE models. ``takes(batch, attn)`` is True for a DECODE step of at most
``max_rows`` requests on the C attention backend whose pools (full, and SWA if any) hold the model's
dtype, any windows; ``run`` then returns the last layer's hidden states, bitwise what the per-layer
Python path computes on dense models without Qwen3's Q/K norms (tests/engine/test_decode_stack.py,
test_decode_stack_gemma.py). Everything else runs the Python path.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from engine import moe
from engine.cpu_linear import small_kernel, small_rows
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kernels import cpu_moe, cpu_native, decode_prefetch

log = logging.getLogger(__name__)

ENV = "PDSERVE_DECODE_STACK"
_I64 = ctypes.c_int64
_MATMULS = ("qkv", "o", "gate_up", "down")
_SHARED = ("shared_gate_up", "shared_down")


class _Layer(ctypes.Structure):
    """``layer_t``: one layer's tensor addresses (0 where absent; a scale only for the int8 kinds) and
    each matmul's kind (``cpu_linear.small_kernel``: the kernel that runs it)."""

    _fields_ = [
        (n, _I64)
        for n in (
            "qkv",
            "qkv_scale",
            "qkv_bias",
            "o",
            "o_scale",
            "gate_up",
            "gate_up_scale",
            "down",
            "down_scale",
            "input_norm",
            "post_norm",
            "kv_base",
            "qkv_kind",
            "o_kind",
            "gate_up_kind",
            "down_kind",
            "router",
            "experts_gate_up",
            "experts_down",
            "experts_gate_up_scale",
            "experts_down_scale",
            "q_norm",
            "k_norm",
            "shared_gate_up",
            "shared_gate_up_scale",
            "shared_gate_up_kind",
            "shared_down",
            "shared_down_scale",
            "shared_down_kind",
            "shared_gate",
            "view",
            "cos",
            "sin",
            "pre_ff_norm",
            "post_ff_norm",
        )
    ]


class _KvView(ctypes.Structure):
    """``kv_view_t``: one (pool, window) of the step: block table, key ranges, out slots, the pool's page
    stride (elements) and the attention threads for those keys."""

    _fields_ = [
        *((n, ctypes.c_void_p) for n in ("table", "lo", "hi", "slots")),
        *((n, _I64) for n in ("table_stride", "page_stride", "attn_threads")),
    ]


class StackArgs(ctypes.Structure):
    """``stack_t``: the step's shapes, positions, views, the pools' shared geometry (strides in
    elements), the attention scale and soft cap, and threads."""

    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        *((n, _I64) for n in ("num_layers", "rows", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        ("positions", ctypes.c_void_p),
        ("views", ctypes.POINTER(_KvView)),
        *((n, _I64) for n in ("P", "v_off", "tok_stride", "head_stride")),
        *((n, ctypes.c_float) for n in ("eps", "scale", "softcap")),
        *((n, _I64) for n in ("attn_prefetch", "mm_threads", "mm_prefetch", "f32", "gemma")),
        *((n, _I64) for n in ("num_experts", "top_k", "norm_topk", "expert_size", "moe_kind", "shared_size")),
    ]


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def is_gemma(model) -> bool:
    """True for ``engine.gemma3.Gemma3Model`` (Gemma 2 and 3 text): its layers run ``gemma_layer``."""
    return hasattr(model, "rope_local")


class DecodeStack:
    """The layers of one ``LlamaModel`` or ``Gemma3Model`` for the C stack: their tensors' addresses,
    bound to the pools and the backend's windows on first use (``_layers_for``)."""

    def __init__(self, model, max_rows: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.gemma = is_gemma(model)
        # (pools' address, windows) -> (layer array, the distinct (pool, window) of the layers' views)
        self._bound: tuple[tuple, ctypes.Array, list[tuple[str, int | None]]] | None = None

    @classmethod
    def build(cls, model) -> DecodeStack | None:
        """The stack for ``model``, or None where it cannot run it (logged at DEBUG with the reason)."""
        cfg, why = model.cfg, None
        if not enabled():
            why = f"{ENV}=0"
        elif model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float32):
            why = "not a bfloat16 or float32 CPU model"
        elif cfg.head_dim % 2:
            why = "odd head_dim"
        elif getattr(cfg, "attention_sinks", False) or getattr(getattr(cfg, "moe", None), "swiglu", None):
            why = "attention sinks and gpt-oss experts, which its kernels do not compute"
        elif cpu_native.load() is None:
            why = "no kernel library here"
        if why is None:
            rows = min(small_rows(layer.w[n]) for layer in model.layers for n in _matmuls(layer))
            bias_ok = all(
                layer.w.get("qkv_bias") is None or layer.w["qkv_bias"].is_contiguous() for layer in model.layers
            )
            why = None if rows and bias_ok else "a layer matmul the small-batch kernel does not take"
        if why is None and getattr(cfg, "moe", None) is not None:
            rows = min(rows, moe.KERNEL_MAX_ROWS)
            why = (
                None
                if rows and all(_experts_run(model, layer) for layer in model.layers if layer.sparse)
                else ("a sparse layer the expert kernel does not take")
            )
        if why is not None:
            log.debug("decode stack off: %s", why)
            return None
        return cls(model, rows)

    def takes(self, batch: ForwardBatch, attn) -> bool:
        """True iff ``run`` serves this step: DECODE, 1..max_rows requests, the C attention backend over
        pools of the model's dtype (the full one and the SWA one if any; any windows)."""
        from engine.attention import CpuBackend

        if batch.mode is not ForwardMode.DECODE or not 1 <= batch.batch_size <= self.max_rows:
            return False
        pools = attn.pools if type(attn) is CpuBackend else None
        return pools is not None and all(
            p is None or p.buffer.dtype == self.model.dtype for p in (pools.full, pools.swa)
        )

    def _layers_for(self, attn) -> tuple[ctypes.Array, list[tuple[str, int | None]]]:
        """The layer array (each layer's K base in its pool, its view: one per distinct (pool, window) of
        the layers, in ``views`` order) for ``attn``'s pools and windows (rebuilt if either changed)."""
        pools = attn.pools
        key = (pools.units.data_ptr(), tuple(attn.windows))
        if self._bound is None or self._bound[0] != key:
            arr, views = (_Layer * len(self.model.layers))(), []
            for i, layer in enumerate(self.model.layers):
                a = arr[i]
                self._bind_tensors(layer, a)
                name, local = pools.layer_pool[i]
                view = (name, attn.windows[i])
                if view not in views:
                    views.append(view)
                a.view = views.index(view)
                buf = pools.pool(name).buffer
                a.kv_base = buf.data_ptr() + local * buf.stride(1) * buf.element_size()
                rope = self.model.rope_of(layer) if self.gemma else self.model.rope
                a.cos, a.sin = rope.cos.data_ptr(), rope.sin.data_ptr()
            self._bound = (key, arr, views)
        return self._bound[1], self._bound[2]

    def _bind_tensors(self, layer, a: _Layer) -> None:
        """``layer``'s weights into ``a``: matmuls by kind, norms (Gemma's as float32 ``1 + weight``,
        ``Gemma3Layer.scales``), a sparse layer's router and experts."""
        w = layer.w
        for n in _matmuls(layer):
            kind, weight, scale = small_kernel(w[n])
            setattr(a, n, weight.data_ptr())
            setattr(a, n + "_scale", _addr(scale))
            setattr(a, n + "_kind", kind)
        a.qkv_bias = _addr(w.get("qkv_bias"))
        if self.gemma:
            sc = layer.scales
            a.input_norm, a.post_norm = sc["input_layernorm"].data_ptr(), sc["post_attention_layernorm"].data_ptr()
            a.pre_ff_norm = sc["pre_feedforward_layernorm"].data_ptr()
            a.post_ff_norm = sc["post_feedforward_layernorm"].data_ptr()
            a.q_norm, a.k_norm = _addr(sc.get("q_norm")), _addr(sc.get("k_norm"))
            return
        a.input_norm, a.post_norm = w["input_norm"].data_ptr(), w["post_norm"].data_ptr()
        a.q_norm, a.k_norm = _addr(w.get("q_norm")), _addr(w.get("k_norm"))
        if layer.sparse:
            a.router = w["router"].data_ptr()
            for n in ("experts_gate_up", "experts_down", "experts_gate_up_scale", "experts_down_scale"):
                # laid-out layers hold only the pair panels, which the expert GEMM's kinds read
                setattr(a, n, _addr(w.get(n + "_pairs", w.get(n))))
            a.shared_gate = _addr(w.get("shared_gate"))

    def run(self, h: torch.Tensor, batch: ForwardBatch, attn) -> torch.Tensor:
        """All layers of a step ``takes`` accepted, on the embedded rows ``h`` ``[rows, hidden]``
        (updated in place and returned). ``attn.prepare(batch)`` has run."""
        m, cfg = self.model, self.model.cfg
        pos = batch.positions
        if not (pos.dtype == torch.int64 and pos.is_contiguous() and h.is_contiguous()):
            raise ValueError("decode stack: positions must be contiguous int64 and the rows contiguous")
        cos = (m.rope_global if self.gemma else m.rope).cos  # every table of a model has one length
        if int(pos.min()) < 0 or int(pos.max()) >= cos.shape[0]:
            raise IndexError(f"rotary position outside 0..{cos.shape[0] - 1}")
        layers, names = self._layers_for(attn)
        torch_threads = torch.get_num_threads()
        views, held = self._views(batch, attn, names, attn.threads or torch_threads)
        s = attn.pools.full.buffer.stride()
        args = StackArgs(
            layers=layers,
            num_layers=len(m.layers),
            rows=batch.batch_size,
            hidden=cfg.hidden_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            inter=cfg.intermediate_size,
            positions=pos.data_ptr(),
            views=views,
            P=attn.pools.full.page_size,
            v_off=s[2],
            tok_stride=s[3],
            head_stride=s[4],
            eps=cfg.rms_norm_eps,
            scale=attn.scale,
            softcap=float(attn.softcap or 0.0),
            attn_prefetch=attn.prefetch,
            mm_threads=torch_threads if cpu_native.openmp_shared() else 1,
            mm_prefetch=decode_prefetch.modes().gemv,
            f32=int(m.dtype == torch.float32),
            gemma=int(self.gemma),
            **self._moe_args(),
        )
        rc = cpu_native.load().pdserve_decode_stack(ctypes.addressof(args), h.data_ptr())
        del held
        if rc != 0:
            raise (MemoryError if rc == -1 else RuntimeError)(f"decode stack failed ({rc})")
        return h

    def _views(self, batch: ForwardBatch, attn, names, threads: int) -> tuple[ctypes.Array, list]:
        """The step's ``kv_view_t`` per (pool, window) of ``names`` (``CpuBackend.pool_decode``: every page
        and slot checked against its pool), and the index tensors they point into (kept alive by the
        caller for the call)."""
        cfg = self.model.cfg
        views, held = (_KvView * len(names))(), []
        for v, (name, window) in zip(views, names):
            table, lo, hi, slots, keys = attn.pool_decode(batch, name, window)
            held += [table, lo, hi, slots]
            v.table, v.lo, v.hi, v.slots = table.data_ptr(), lo.data_ptr(), hi.data_ptr(), slots.data_ptr()
            v.table_stride, v.page_stride = table.stride(0), attn.pools.pool(name).buffer.stride(0)
            v.attn_threads = cpu_native.threads_for(keys, cfg.num_heads, cfg.head_dim, threads)
        return views, held

    def _moe_args(self) -> dict[str, int]:
        """The sparse layers' settings for ``StackArgs`` (no experts: every layer dense)."""
        spec, m = getattr(self.model.cfg, "moe", None), self.model
        if spec is None:
            return {}
        int8 = any(moe.experts_dtype(layer.w) == torch.int8 for layer in m.layers if layer.sparse)
        kind = cpu_moe.KIND_I8 if int8 else cpu_moe.KIND_F32 if m.dtype == torch.float32 else cpu_moe.KIND_BF16
        if _gemm_experts(m):
            kind = cpu_moe.KIND_GEMM_I8 if int8 else cpu_moe.KIND_GEMM_BF16
        return {
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "norm_topk": int(spec.norm_topk_prob),
            "expert_size": spec.expert_size,
            "moe_kind": kind,
            "shared_size": spec.shared_expert_size,
        }


def _matmuls(layer) -> tuple[str, ...]:
    """The packed matmuls of ``layer``: attention's, and the dense MLP's unless the layer is sparse, when
    it has its shared expert's (Qwen2-MoE; run by the same kernels as a dense MLP's) if any."""
    if not getattr(layer, "sparse", False):
        return _MATMULS
    return _MATMULS[:2] + (_SHARED if "shared_down" in layer.w else ())


def _gemm_experts(model) -> bool:
    """True iff every sparse layer has its experts in the expert GEMM's layout (``engine.moe.gemm_layout``):
    the stack then runs them by that kernel (faster than the dot-product one at every row count)."""
    sparse = [layer.w for layer in model.layers if layer.sparse]
    return bool(sparse) and model.dtype == torch.bfloat16 and all("experts_down_pairs" in w for w in sparse)


def _experts_run(model, layer) -> bool:
    """True iff the stack runs ``layer``'s expert block: a router (and a shared-expert gate row, if any)
    of the model dtype, contiguous, and
    experts the kind's kernel takes (int8 experts with their scales, all int8 or none): laid out, every
    sparse layer laid out and ``cpu_moe.pairs_take``; else ``cpu_moe.takes``."""
    w = layer.w
    router, probe = w["router"], torch.empty(1, model.cfg.hidden_size, dtype=model.dtype)
    int8 = moe.experts_dtype(w) == torch.int8
    scales = all(w.get(n) is not None for n in ("experts_gate_up_scale", "experts_down_scale")) == int8
    pairs = moe.laid_out(w)
    if pairs is not None:
        experts = _gemm_experts(model) and cpu_moe.pairs_take(probe, *pairs)
    else:
        experts = cpu_moe.takes(probe, w["experts_gate_up"], w["experts_down"])
    gate = w.get("shared_gate")
    gate_ok = gate is None or (gate.dtype == model.dtype and gate.is_contiguous() and gate.numel() == router.shape[1])
    return router.dtype == model.dtype and router.is_contiguous() and scales and experts and gate_ok
