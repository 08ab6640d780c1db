/* A decode step's transformer layers (Llama family, Gemma 2 / 3) in one call: the same kernels, in the same order,
 * as engine/model.py's DecoderLayer.forward runs them from Python one call at a time.
 *
 * Why: at 1-8 rows a layer's kernels each take microseconds, and the Python around each call (the
 * wrapper's checks, a new output tensor, the ctypes call) costs about as much again: ~12 calls per
 * layer, every layer, every step. Here the layer loop is C: the Python cost is one call
 * per step, and the scratch rows stay in cache between the kernels.
 *
 * Exactness: every value is computed by the kernel the Python path calls for it (gemv, RMSNorm,
 * rotary, KV store, paged decode attention, SiLU-and-multiply), and the two glue steps round as
 * torch does: the attention output (float32) to bfloat16 round-to-nearest-even, and the residual add
 * h + down as float32 sum rounded to bfloat16. So the step's output is bitwise the Python path's
 * (tests/engine/test_decode_stack.py holds it to torch.equal).
 *
 * float32 models (s->f32): float32 activations, KV pool and weights in cpu_gemm_pairs.c's float32
 * panels; the same kernels in float32 with nothing rounded between them (the residual add is the
 * float32 sum torch computes), so it is bitwise the Python path there too.
 *
 * Mixture-of-experts layers (layer_t.router set): the MLP is the expert block (moe_block below: router,
 * top-k, cpu_moe.c's experts), as engine/moe.py's moe_mlp computes it, and Qwen2-MoE's gated shared
 * expert (layer_t.shared_down) on the dense MLP's kernels; Q/K norms (layer_t.q_norm) are
 * per-head RMSNorms after the QKV matmul. Neither is bitwise torch (the router's and the norms' sums
 * run in another order); the dense layers above still are.
 *
 * Gemma 2 / Gemma 3 text layers (s->gemma): gemma_layer below, the block engine/gemma3.py's
 * Gemma3Layer.forward runs, by the same fused kernels in the same order: bitwise its output too.
 *
 * Attention: each layer reads one kv_view_t of the step (layer_t.view): the block tables, key ranges
 * and slots of its pool (the full pool, or a hybrid's SWA pool) under its window (a sliding layer's
 * range is its last `window` keys), at its own K base in that pool, rotated by its own tables (Gemma's
 * local base on sliding layers), the logits soft-capped where s->softcap (Gemma 2).
 *
 * Contract: bfloat16 activations, weights and KV pools (or all float32, above); rows 1..8 where a matmul runs cpu_gemv.c (in %
 * 32 == 0, out % 8 == 0), any where all run cpu_gemm_pairs.c (out % 64 == 0, in even); each weight
 * plain bfloat16 or weight-only int8 with float32 row scales, in the layout of its kind; Gemma's
 * norm scales float32; the pools share page size and strides but the page stride (per view); the
 * caller has checked the positions against the rotary tables and every slot and table entry of every
 * view against its pool. Returns 0, -1
 * when scratch cannot be allocated, -2 when a matmul refuses its shape (nothing of a later layer has
 * run then, but earlier layers' KV is stored: the caller fails the step). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

/* the other kernel files' entry points (one library, cpu_library.py) */
void pdserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int64_t dim,
                      float eps, int bf16, int threads);
void pdserve_rms_norm_f32w(const void *x, int64_t x_stride, const float *w, void *out, int64_t rows, int64_t dim,
                           float eps, int bf16, int threads);
void pdserve_add_rms_norm(void *h, const void *res, const void *w, void *out, int64_t rows, int64_t dim,
                          float eps, int bf16, int threads);
void pdserve_rope(void *x, int64_t tok_stride, const int64_t *pos, const float *cos, const float *sin,
                  int64_t tokens, int64_t heads, int64_t head_dim, int bf16, int threads);
void pdserve_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int threads);
void pdserve_gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int threads);
void pdserve_store_kv(void *kv, int64_t page_stride, int64_t v_off, int64_t tok_stride, int64_t P,
                      const int64_t *slots, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                      int64_t tokens, int64_t row, int64_t esize);
int pdserve_gemv_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t rows, int64_t in, int64_t out, int threads, int prefetch);
int pdserve_gemv_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale, const uint16_t *bias,
                     uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads, int prefetch);
int pdserve_gemm_pairs_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                            int64_t rows, int64_t in, int64_t out, int threads);
int pdserve_gemm_pairs_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale,
                           const uint16_t *bias, uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads);
int pdserve_gemm_panels_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                            int64_t rows, int64_t in, int64_t out, int threads);
int pdserve_moe_experts(const void *x, int64_t x_stride, const void *gate_up, const void *down, int kind,
                        const float *gate_up_scale, const float *down_scale, const int64_t *experts,
                        const int64_t *offsets, const int64_t *pair_tok, const float *pair_w, void *act, float *out,
                        int64_t chosen, int64_t hidden, int64_t inter, int threads);
int pdserve_paged_decode(const float *q, const void *kv, int bf16, const int64_t *table, int64_t table_stride,
                         const int64_t *lo, const int64_t *hi, float *out, int64_t B, int64_t H, int64_t Hkv,
                         int64_t D, int64_t P, int64_t page_stride, int64_t v_off, int64_t tok_stride,
                         int64_t head_stride, float scale, int threads, int prefetch, int dot, float softcap);

/* How a matmul's weight is stored, i.e. which kernel runs it (engine/decode_stack.py's KINDS). */
enum { GEMV_BF16 = 0, GEMV_I8 = 1, PAIRS_BF16 = 2, PAIRS_I8 = 3, PANELS_F32 = 4 };

/* One layer's tensors (addresses; 0 where absent; scale only for the int8 kinds) and matmul kinds. */
typedef struct {
    int64_t qkv, qkv_scale, qkv_bias, o, o_scale, gate_up, gate_up_scale, down, down_scale;
    int64_t input_norm, post_norm, kv_base; /* kv_base: the layer's K of page 0 in the pool */
    int64_t qkv_kind, o_kind, gate_up_kind, down_kind;
    /* a sparse layer: its router [experts, hidden] (0: the dense MLP above), stacked experts as
     * cpu_moe.c takes them (int8 with float32 row scales); per-head Q/K norm weights (0: none) */
    int64_t router, experts_gate_up, experts_down, experts_gate_up_scale, experts_down_scale, q_norm, k_norm;
    /* a sparse layer's shared expert (shared_down 0: none): its gate-up and down in the dense MLP's
     * layouts and kinds, and its gate row [1, hidden] of the model dtype */
    int64_t shared_gate_up, shared_gate_up_scale, shared_gate_up_kind, shared_down, shared_down_scale, shared_down_kind;
    int64_t shared_gate;
    /* the kv_view_t this layer attends over (stack_t.views), its rotary tables (float32 [positions,
     * head_dim]); Gemma's norms before and after the MLP (float32 1 + weight; 0: a Llama layer) */
    int64_t view, cos, sin, pre_ff_norm, post_ff_norm;
} layer_t;

/* One (pool, window) of the step: each request's block table row, its key range [lo, hi) (hi - window
 * to hi under a window), its new token's slot in that pool, the pool's page stride (elements) and the
 * attention threads for the range's keys. */
typedef struct {
    const int64_t *table, *lo, *hi, *slots;
    int64_t table_stride, page_stride, attn_threads;
} kv_view_t;

/* The step: shapes, per-token indices, pool geometry (strides in elements), threads. Mirrored by
 * engine/decode_stack.py's StackArgs. */
typedef struct {
    const layer_t *layers;
    int64_t num_layers, rows, hidden, heads, kv_heads, head_dim, inter;
    const int64_t *positions;
    const kv_view_t *views; /* indexed by layer_t.view */
    int64_t P, v_off, tok_stride, head_stride; /* the pools' geometry but their page strides */
    float eps, scale, softcap;                 /* softcap: attention logits' tanh cap (0: none) */
    int64_t attn_prefetch, mm_threads, mm_prefetch;
    int64_t f32;   /* 1: float32 activations, weights (PANELS_F32) and pool; 0: bfloat16 */
    int64_t gemma; /* 1: Gemma 2 / 3 layers (gemma_layer below) */
    /* the sparse layers' experts (0 experts: none), top-k, renormalized or not, cpu_moe.c's kind */
    int64_t num_experts, top_k, norm_topk, expert_size, moe_kind;
    int64_t shared_size; /* the shared expert's intermediate size (0: none) */
} stack_t;

static int matmul(const stack_t *s, int64_t kind, const uint16_t *x, int64_t w, int64_t scale, int64_t bias,
                  uint16_t *y, int64_t in, int64_t out) {
    const int th = (int)s->mm_threads, pf = (int)s->mm_prefetch;
    const uint16_t *b = (const uint16_t *)bias;
    switch (kind) {
    case GEMV_BF16: return pdserve_gemv_bf16(x, in, (const uint16_t *)w, b, y, s->rows, in, out, th, pf);
    case GEMV_I8: return pdserve_gemv_i8w(x, in, (const int8_t *)w, (const float *)scale, b, y, s->rows, in, out, th, pf);
    case PAIRS_BF16: return pdserve_gemm_pairs_bf16(x, in, (const uint16_t *)w, b, y, s->rows, in, out, th);
    case PAIRS_I8:
        return pdserve_gemm_pairs_i8w(x, in, (const int8_t *)w, (const float *)scale, b, y, s->rows, in, out, th);
    }
    return -1;
}

static int matmul_f32(const stack_t *s, int64_t kind, const float *x, int64_t w, int64_t bias, float *y, int64_t in,
                      int64_t out) {
    if (kind != PANELS_F32) return -1;
    return pdserve_gemm_panels_f32(x, in, (const float *)w, (const float *)bias, y, s->rows, in, out, (int)s->mm_threads);
}

static void *carve(char **p, int64_t bytes) {
    void *r = *p;
    *p += (bytes + 63) & ~(int64_t)63;
    return r;
}

/* ---- the mixture-of-experts block (engine/moe.py's moe_mlp, one sparse layer) ----
 * Router logits x . router_e summed in float32 (rounded to bfloat16 for a bfloat16 model, as torch's
 * bfloat16 matmul output is), softmax in float32, the top_k largest (ties: the lower expert), their
 * probabilities renormalized to sum 1 where norm_topk, then rounded to the model dtype (moe.route's
 * weights.to(x.dtype)). The (token, slot) pairs are grouped by expert in increasing expert order,
 * tokens in order within one expert (moe_mlp's stable argsort), and cpu_moe.c runs them: the same
 * call, with the same grouping, as the per-layer path makes, so only the router's summation order
 * differs from torch's. */
typedef struct {
    float *logits, *pair_w, *out;
    int64_t *slot_e, *count, *experts, *offsets, *pair_tok;
    char *act, *shared_gu, *shared_act, *shared_out; /* shared_*: the shared expert's rows (model dtype) */
} moe_scratch_t;

static int64_t moe_bytes(const stack_t *s) {
    const int64_t R = s->rows, E = s->num_experts, K = s->top_k, es = s->f32 ? 4 : 2;
    if (E == 0) return 0;
    return 64 * 12 + 4 * R * E + 4 * R * K + 4 * R * s->hidden + 8 * R * K * 2 + 8 * (3 * E + 1) +
           es * R * K * s->expert_size + es * R * (3 * s->shared_size + s->hidden);
}

static void moe_carve(char **p, const stack_t *s, moe_scratch_t *m) {
    const int64_t R = s->rows, E = s->num_experts, K = s->top_k, es = s->f32 ? 4 : 2;
    memset(m, 0, sizeof *m);
    if (E == 0) return;
    m->logits = carve(p, 4 * R * E);
    m->pair_w = carve(p, 4 * R * K);
    m->out = carve(p, 4 * R * s->hidden);
    m->slot_e = carve(p, 8 * R * K);
    m->pair_tok = carve(p, 8 * R * K);
    m->count = carve(p, 8 * E);
    m->experts = carve(p, 8 * E);
    m->offsets = carve(p, 8 * (E + 1));
    m->act = carve(p, es * R * K * s->expert_size);
    m->shared_gu = carve(p, es * R * 2 * s->shared_size);
    m->shared_act = carve(p, es * R * s->shared_size);
    m->shared_out = carve(p, es * R * s->hidden);
}

static float dot_row(const void *x, const void *w, int64_t n, int f32) {
    vf acc = {};
    if (f32)
        for (int64_t c = 0; c < n; c += W) acc += vld_f32((const float *)x + c) * vld_f32((const float *)w + c);
    else
        for (int64_t c = 0; c < n; c += W) acc += vld_bf16((const uint16_t *)x + c) * vld_bf16((const uint16_t *)w + c);
    return hsum(acc);
}

/* Each row's top_k experts (slot_e) and weights (pair_w), [rows, top_k]. The logits run expert-outer
 * (a router row is read once from memory for all the step's rows), the experts split over the threads;
 * each logit is one thread's sum, so the result does not depend on the thread count. */
static void route(const stack_t *s, const layer_t *l, const void *x, const moe_scratch_t *m) {
    const int64_t E = s->num_experts, K = s->top_k, Hd = s->hidden, R = s->rows, es = s->f32 ? 4 : 2;
    const int threads = E * R * Hd >= (1 << 18) && s->mm_threads > 1 ? (int)s->mm_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < R; r++) {
            const float v = dot_row((const char *)x + r * Hd * es, (const char *)l->router + e * Hd * es, Hd, (int)s->f32);
            m->logits[r * E + e] = s->f32 ? v : bf16_to_f32(f32_to_bf16(v));
        }
    for (int64_t r = 0; r < R; r++) {
        float *p = m->logits + r * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        float picked = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) /* chosen ones are marked -1 (probabilities are >= 0) */
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            m->slot_e[r * K + k] = best;
            m->pair_w[r * K + k] = p[best];
            picked += p[best];
            p[best] = -1.0f;
        }
        for (int64_t k = 0; k < K; k++) {
            float w = s->norm_topk ? m->pair_w[r * K + k] / picked : m->pair_w[r * K + k];
            m->pair_w[r * K + k] = s->f32 ? w : bf16_to_f32(f32_to_bf16(w));
        }
    }
}

/* The shared expert of rows x into m->shared_out (model dtype): sigmoid(x . gate) * down(silu(gate(x)) *
 * up(x)), engine/moe.py's shared_expert: its matmuls by the dense MLP's kernels, the gate logit summed
 * in float32 (rounded to bfloat16, then the sigmoid and the product each rounded, as torch's bfloat16 ops
 * are). Nothing when the layer has none. Returns 0, or -1 for a shape a matmul refuses. */
static int shared_expert(const stack_t *s, const layer_t *l, const void *x, const moe_scratch_t *m) {
    const int64_t R = s->rows, Hd = s->hidden, S = s->shared_size;
    if (!l->shared_down) return 0;
    if (s->f32) {
        if (matmul_f32(s, l->shared_gate_up_kind, x, l->shared_gate_up, 0, (float *)m->shared_gu, Hd, 2 * S)) return -1;
        pdserve_silu_mul(m->shared_gu, m->shared_act, R, S, 0, 1);
        if (matmul_f32(s, l->shared_down_kind, (const float *)m->shared_act, l->shared_down, 0, (float *)m->shared_out,
                       S, Hd))
            return -1;
    } else {
        if (matmul(s, l->shared_gate_up_kind, x, l->shared_gate_up, l->shared_gate_up_scale, 0,
                   (uint16_t *)m->shared_gu, Hd, 2 * S))
            return -1;
        pdserve_silu_mul(m->shared_gu, m->shared_act, R, S, 1, 1);
        if (matmul(s, l->shared_down_kind, (const uint16_t *)m->shared_act, l->shared_down, l->shared_down_scale, 0,
                   (uint16_t *)m->shared_out, S, Hd))
            return -1;
    }
    const int64_t es = s->f32 ? 4 : 2;
    for (int64_t r = 0; r < R; r++) {
        float g = dot_row((const char *)x + r * Hd * es, (const void *)l->shared_gate, Hd, (int)s->f32);
        if (!s->f32) g = bf16_to_f32(f32_to_bf16(g));
        float sig = 1.0f / (1.0f + expf(-g));
        if (s->f32) {
            float *y = (float *)m->shared_out + r * Hd;
            for (int64_t i = 0; i < Hd; i++) y[i] *= sig;
        } else {
            uint16_t *y = (uint16_t *)m->shared_out + r * Hd;
            sig = bf16_to_f32(f32_to_bf16(sig));
            for (int64_t i = 0; i < Hd; i++) y[i] = f32_to_bf16(sig * bf16_to_f32(y[i]));
        }
    }
    return 0;
}

/* The block's output for rows x, added to h (bfloat16: the float32 sums rounded, then the bfloat16
 * add torch does; float32: added). Returns cpu_moe.c's code (0, or -1 for a shape it refuses). */
static int moe_block(const stack_t *s, const layer_t *l, const void *x, void *h, const moe_scratch_t *m) {
    const int64_t R = s->rows, E = s->num_experts, K = s->top_k, Hd = s->hidden;
    route(s, l, x, m);
    float *w = m->logits; /* the logits are spent: they hold the weights in grouped order */
    memset(m->count, 0, 8 * E);
    for (int64_t i = 0; i < R * K; i++) m->count[m->slot_e[i]]++;
    int64_t chosen = 0, at = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!m->count[e]) continue;
        m->experts[chosen] = e;
        m->offsets[chosen++] = at;
        const int64_t n = m->count[e];
        m->count[e] = at; /* from here: the next free position of expert e's pairs */
        at += n;
    }
    m->offsets[chosen] = at;
    for (int64_t i = 0; i < R * K; i++) {
        const int64_t pos = m->count[m->slot_e[i]]++;
        m->pair_tok[pos] = i / K;
        w[pos] = m->pair_w[i];
    }
    memset(m->out, 0, 4 * R * Hd);
    int rc = shared_expert(s, l, x, m);
    if (rc) return rc;
    rc = pdserve_moe_experts(x, Hd, (const void *)l->experts_gate_up, (const void *)l->experts_down,
                                 (int)s->moe_kind, (const float *)l->experts_gate_up_scale,
                                 (const float *)l->experts_down_scale, m->experts, m->offsets, m->pair_tok, w, m->act,
                                 m->out, chosen, Hd, s->expert_size, (int)s->mm_threads);
    if (rc) return rc;
    if (!l->shared_down) {
        if (s->f32)
            for (int64_t i = 0; i < R * Hd; i++) ((float *)h)[i] += m->out[i];
        else
            for (int64_t i = 0; i < R * Hd; i++) {
                uint16_t *hb = (uint16_t *)h;
                hb[i] = f32_to_bf16(bf16_to_f32(hb[i]) + bf16_to_f32(f32_to_bf16(m->out[i])));
            }
        return 0;
    }
    /* h + (mixture + shared), the per-layer path's order; bfloat16 rounds the mixture and the sum */
    if (s->f32)
        for (int64_t i = 0; i < R * Hd; i++) ((float *)h)[i] += m->out[i] + ((const float *)m->shared_out)[i];
    else
        for (int64_t i = 0; i < R * Hd; i++) {
            uint16_t *hb = (uint16_t *)h;
            const float t = bf16_to_f32(f32_to_bf16(m->out[i])) + bf16_to_f32(((const uint16_t *)m->shared_out)[i]);
            hb[i] = f32_to_bf16(bf16_to_f32(hb[i]) + bf16_to_f32(f32_to_bf16(t)));
        }
    return 0;
}

/* Per-head RMSNorm of each row's Q and K heads in place (the Q/K norms of Qwen3; Gemma 3's with float32
 * 1 + weight scales). */
static void qk_norm(const stack_t *s, const layer_t *l, void *qkv, int64_t qkv_w, int bf16) {
    const int64_t D = s->head_dim, qs = s->heads * D, es = bf16 ? 2 : 4;
    if (!l->q_norm) return;
    for (int64_t r = 0; r < s->rows; r++) {
        char *q = (char *)qkv + r * qkv_w * es, *k = q + qs * es;
        if (s->gemma) {
            pdserve_rms_norm_f32w(q, D, (const float *)l->q_norm, q, s->heads, D, s->eps, bf16, 1);
            pdserve_rms_norm_f32w(k, D, (const float *)l->k_norm, k, s->kv_heads, D, s->eps, bf16, 1);
        } else {
            pdserve_rms_norm(q, D, (const void *)l->q_norm, q, s->heads, D, s->eps, bf16, 1);
            pdserve_rms_norm(k, D, (const void *)l->k_norm, k, s->kv_heads, D, s->eps, bf16, 1);
        }
    }
}

/* The attention of one layer on its QKV rows [rows, qkv_w] (model dtype; Q/K normed): Q and K rotated
 * by the layer's tables in place, K and V stored into the layer's pool at the view's slots, each row's
 * query (as float32 in qf) against the view's key range; the output, float32 in of, also rounded to
 * bfloat16 into attn when the model is bfloat16 (what the O matmul reads). */
static void attend(const stack_t *s, const layer_t *l, void *qkv, float *qf, float *of, uint16_t *attn) {
    const int64_t R = s->rows, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D, qkv_w = qs + 2 * kvs;
    const int bf16 = !s->f32, es = bf16 ? 2 : 4;
    const kv_view_t *v = s->views + l->view;
    const float *cos = (const float *)l->cos, *sin = (const float *)l->sin;
    char *q = (char *)qkv, *k = q + qs * es;
    pdserve_rope(q, qkv_w, s->positions, cos, sin, R, s->heads, D, bf16, 1);
    pdserve_rope(k, qkv_w, s->positions, cos, sin, R, s->kv_heads, D, bf16, 1);
    pdserve_store_kv((void *)l->kv_base, v->page_stride, s->v_off, s->tok_stride, s->P, v->slots, k, qkv_w,
                     k + kvs * es, qkv_w, R, kvs, es);
    for (int64_t r = 0; r < R; r++) { /* the kernel reads float32 queries */
        if (bf16)
            for (int64_t i = 0; i < qs; i++) qf[r * qs + i] = bf16_to_f32(((const uint16_t *)q)[r * qkv_w + i]);
        else
            memcpy(qf + r * qs, (const float *)q + r * qkv_w, qs * sizeof(float));
    }
    pdserve_paged_decode(qf, (const void *)l->kv_base, bf16, v->table, v->table_stride, v->lo, v->hi, of, R, s->heads,
                         s->kv_heads, D, s->P, v->page_stride, s->v_off, s->tok_stride, s->head_stride, s->scale,
                         (int)v->attn_threads, (int)s->attn_prefetch, bf16, s->softcap);
    if (bf16)
        for (int64_t i = 0; i < R * qs; i++) attn[i] = f32_to_bf16(of[i]);
}

/* Scratch rows of one step, carved from one allocation. */
typedef struct {
    uint16_t *x, *qkv, *attn, *tmp, *gate_up, *act;
    float *qf, *of;
    moe_scratch_t moe;
} scratch_t;

static int one_layer(const stack_t *s, const layer_t *l, uint16_t *h, const scratch_t *b) {
    const int64_t R = s->rows, Hd = s->hidden, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D;
    const int64_t qkv_w = qs + 2 * kvs;
    pdserve_rms_norm(h, Hd, (const void *)l->input_norm, b->x, R, Hd, s->eps, 1, 1);
    if (matmul(s, l->qkv_kind, b->x, l->qkv, l->qkv_scale, l->qkv_bias, b->qkv, Hd, qkv_w)) return -2;
    qk_norm(s, l, b->qkv, qkv_w, 1);
    attend(s, l, b->qkv, b->qf, b->of, b->attn);
    if (matmul(s, l->o_kind, b->attn, l->o, l->o_scale, 0, b->tmp, qs, Hd)) return -2;
    pdserve_add_rms_norm(h, b->tmp, (const void *)l->post_norm, b->x, R, Hd, s->eps, 1, 1);
    if (l->router) return moe_block(s, l, b->x, h, &b->moe) ? -2 : 0;
    if (matmul(s, l->gate_up_kind, b->x, l->gate_up, l->gate_up_scale, 0, b->gate_up, Hd, 2 * s->inter)) return -2;
    pdserve_silu_mul(b->gate_up, b->act, R, s->inter, 1, 1);
    if (matmul(s, l->down_kind, b->act, l->down, l->down_scale, 0, b->tmp, s->inter, Hd)) return -2;
    for (int64_t i = 0; i < R * Hd; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(b->tmp[i]));
    return 0;
}

/* ---- float32 layers: the same order over float32 rows (no roundings between the kernels) ---- */
typedef struct {
    float *x, *qkv, *qf, *of, *tmp, *gate_up, *act;
    moe_scratch_t moe;
} scratch_f32_t;

static int one_layer_f32(const stack_t *s, const layer_t *l, float *h, const scratch_f32_t *b) {
    const int64_t R = s->rows, Hd = s->hidden, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D;
    const int64_t qkv_w = qs + 2 * kvs;
    pdserve_rms_norm(h, Hd, (const void *)l->input_norm, b->x, R, Hd, s->eps, 0, 1);
    if (matmul_f32(s, l->qkv_kind, b->x, l->qkv, l->qkv_bias, b->qkv, Hd, qkv_w)) return -2;
    qk_norm(s, l, b->qkv, qkv_w, 0);
    attend(s, l, b->qkv, b->qf, b->of, NULL);
    if (matmul_f32(s, l->o_kind, b->of, l->o, 0, b->tmp, qs, Hd)) return -2;
    pdserve_add_rms_norm(h, b->tmp, (const void *)l->post_norm, b->x, R, Hd, s->eps, 0, 1);
    if (l->router) return moe_block(s, l, b->x, h, &b->moe) ? -2 : 0;
    if (matmul_f32(s, l->gate_up_kind, b->x, l->gate_up, 0, b->gate_up, Hd, 2 * s->inter)) return -2;
    pdserve_silu_mul(b->gate_up, b->act, R, s->inter, 0, 1);
    if (matmul_f32(s, l->down_kind, b->act, l->down, 0, b->tmp, s->inter, Hd)) return -2;
    for (int64_t i = 0; i < R * Hd; i++) h[i] += b->tmp[i];
    return 0;
}

/* ---- Gemma 2 / Gemma 3 layers (engine/gemma3.py's Gemma3Layer.forward), either dtype ----
 * Four norms with float32 1 + weight scales (pdserve_rms_norm_f32w): before attention (input_norm),
 * on the attention's output before its residual add (post_norm), before the MLP (pre_ff_norm), on the
 * MLP's output before its residual add (post_ff_norm); the GELU-tanh MLP; each residual add rounded
 * as torch's add of two rows of the model dtype. Attention as the Llama layers' (attend), over the
 * layer's own view (a sliding layer's window, its pool), its tables and the soft cap. */
typedef struct {
    void *x, *qkv, *attn, *tmp, *gate_up, *act; /* model dtype; attn: the O matmul's input */
    float *qf, *of;
} gemma_bufs_t;

static int mm(const stack_t *s, int64_t kind, const void *x, int64_t w, int64_t scale, void *y, int64_t in,
              int64_t out) {
    return s->f32 ? matmul_f32(s, kind, x, w, 0, y, in, out) : matmul(s, kind, x, w, scale, 0, y, in, out);
}

/* h += x ([rows, hidden], model dtype; bfloat16: the float32 sum rounded). */
static void residual(const stack_t *s, void *h, const void *x) {
    const int64_t n = s->rows * s->hidden;
    if (s->f32)
        for (int64_t i = 0; i < n; i++) ((float *)h)[i] += ((const float *)x)[i];
    else
        for (int64_t i = 0; i < n; i++) {
            uint16_t *hb = (uint16_t *)h;
            hb[i] = f32_to_bf16(bf16_to_f32(hb[i]) + bf16_to_f32(((const uint16_t *)x)[i]));
        }
}

/* Threads for an elementwise kernel over n elements: engine/kernels/fused.py's rule (PARALLEL_ELEMENTS,
 * torch's threads where the runtime is shared: mm_threads); its rows split, so any count gives the same
 * output. Gemma's GELU over a wide MLP is the step's largest elementwise work. */
static int ew_threads(const stack_t *s, int64_t n) { return n >= (1 << 15) ? (int)s->mm_threads : 1; }

static int gemma_layer(const stack_t *s, const layer_t *l, void *h, const gemma_bufs_t *b) {
    const int64_t R = s->rows, Hd = s->hidden, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D;
    const int64_t qkv_w = qs + 2 * kvs, I = s->inter;
    const int bf16 = !s->f32, th = ew_threads(s, R * Hd);
    pdserve_rms_norm_f32w(h, Hd, (const float *)l->input_norm, b->x, R, Hd, s->eps, bf16, th);
    if (mm(s, l->qkv_kind, b->x, l->qkv, l->qkv_scale, b->qkv, Hd, qkv_w)) return -2;
    qk_norm(s, l, b->qkv, qkv_w, bf16);
    attend(s, l, b->qkv, b->qf, b->of, bf16 ? (uint16_t *)b->attn : NULL);
    if (mm(s, l->o_kind, b->attn, l->o, l->o_scale, b->tmp, qs, Hd)) return -2;
    pdserve_rms_norm_f32w(b->tmp, Hd, (const float *)l->post_norm, b->x, R, Hd, s->eps, bf16, th);
    residual(s, h, b->x);
    pdserve_rms_norm_f32w(h, Hd, (const float *)l->pre_ff_norm, b->x, R, Hd, s->eps, bf16, th);
    if (mm(s, l->gate_up_kind, b->x, l->gate_up, l->gate_up_scale, b->gate_up, Hd, 2 * I)) return -2;
    pdserve_gelu_tanh_mul(b->gate_up, b->act, R, I, bf16, ew_threads(s, R * I));
    if (mm(s, l->down_kind, b->act, l->down, l->down_scale, b->tmp, I, Hd)) return -2;
    pdserve_rms_norm_f32w(b->tmp, Hd, (const float *)l->post_ff_norm, b->x, R, Hd, s->eps, bf16, th);
    residual(s, h, b->x);
    return 0;
}

static int stack_f32(const stack_t *s, float *h) {
    const int64_t R = s->rows, qs = s->heads * s->head_dim, kvs = s->kv_heads * s->head_dim;
    const int64_t widest = s->hidden > qs ? s->hidden : qs;
    const int64_t bytes = 64 * 8 + 4 * R * (widest + (qs + 2 * kvs) + 2 * qs + widest + 3 * s->inter) + moe_bytes(s);
    char *mem = malloc(bytes), *p = mem;
    if (!mem) return -1;
    scratch_f32_t b;
    b.x = carve(&p, 4 * R * widest);
    b.qkv = carve(&p, 4 * R * (qs + 2 * kvs));
    b.qf = carve(&p, 4 * R * qs);
    b.of = carve(&p, 4 * R * qs);
    b.tmp = carve(&p, 4 * R * widest);
    b.gate_up = carve(&p, 4 * R * 2 * s->inter);
    b.act = carve(&p, 4 * R * s->inter);
    moe_carve(&p, s, &b.moe);
    int rc = 0;
    const gemma_bufs_t g = {b.x, b.qkv, b.of, b.tmp, b.gate_up, b.act, b.qf, b.of};
    for (int64_t i = 0; i < s->num_layers && rc == 0; i++)
        rc = s->gemma ? gemma_layer(s, s->layers + i, h, &g) : one_layer_f32(s, s->layers + i, h, &b);
    free(mem);
    return rc;
}

/* h: [rows, hidden] bfloat16 (float32 when s->f32), the residual stream after the embedding; updated
 * in place to the last layer's output (before the final norm). */
int pdserve_decode_stack(const stack_t *s, uint16_t *h) {
    if (s->f32) return stack_f32(s, (float *)h);
    const int64_t R = s->rows, qs = s->heads * s->head_dim, kvs = s->kv_heads * s->head_dim;
    const int64_t widest = s->hidden > qs ? s->hidden : qs;
    const int64_t bytes =
        64 * 8 + R * (2 * (widest + (qs + 2 * kvs) + qs + s->hidden + 3 * s->inter) + 4 * 2 * qs) + moe_bytes(s);
    char *mem = malloc(bytes), *p = mem;
    if (!mem) return -1;
    scratch_t b;
    b.x = carve(&p, 2 * R * widest);
    b.qkv = carve(&p, 2 * R * (qs + 2 * kvs));
    b.attn = carve(&p, 2 * R * qs);
    b.tmp = carve(&p, 2 * R * s->hidden);
    b.gate_up = carve(&p, 2 * R * 2 * s->inter);
    b.act = carve(&p, 2 * R * s->inter);
    b.qf = carve(&p, 4 * R * qs);
    b.of = carve(&p, 4 * R * qs);
    moe_carve(&p, s, &b.moe);
    int rc = 0;
    const gemma_bufs_t g = {b.x, b.qkv, b.attn, b.tmp, b.gate_up, b.act, b.qf, b.of};
    for (int64_t i = 0; i < s->num_layers && rc == 0; i++)
        rc = s->gemma ? gemma_layer(s, s->layers + i, h, &g) : one_layer(s, s->layers + i, h, &b);
    free(mem);
    return rc;
}
