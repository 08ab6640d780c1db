/* A decode step's transformer layers (Llama family) in one call: the same kernels, in the same order,
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
 * Contract: bfloat16 activations, weights and KV pool (or all float32, above); rows 1..8 where a matmul runs cpu_gemv.c (in %
 * 32 == 0, out % 8 == 0), any where all run cpu_gemm_pairs.c (out % 64 == 0, in even); each weight
 * plain bfloat16 or weight-only int8 with float32 row scales, in the layout of its kind;
 * every layer attends over the whole sequence (no window) of one pool; the caller has checked the
 * positions against the rotary tables and every slot and table entry against the pool. Returns 0, -1
 * when scratch cannot be allocated, -2 when a matmul refuses its shape (nothing of a later layer has
 * run then, but earlier layers' KV is stored: the caller fails the step). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

/* the other kernel files' entry points (one library, cpu_library.py) */
void pdserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int64_t dim,
                      float eps, int bf16, int threads);
void pdserve_add_rms_norm(void *h, const void *res, const void *w, void *out, int64_t rows, int64_t dim,
                          float eps, int bf16, int threads);
void pdserve_rope(void *x, int64_t tok_stride, const int64_t *pos, const float *cos, const float *sin,
                  int64_t tokens, int64_t heads, int64_t head_dim, int bf16, int threads);
void pdserve_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int threads);
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
} layer_t;

/* The step: shapes, per-token indices, pool geometry (strides in elements), threads. Mirrored by
 * engine/decode_stack.py's StackArgs. */
typedef struct {
    const layer_t *layers;
    int64_t num_layers, rows, hidden, heads, kv_heads, head_dim, inter;
    const int64_t *positions, *slots, *table, *lo, *hi;
    int64_t table_stride, P, page_stride, v_off, tok_stride, head_stride;
    const float *cos, *sin;
    float eps, scale;
    int64_t attn_threads, attn_prefetch, mm_threads, mm_prefetch;
    int64_t f32; /* 1: float32 activations, weights (PANELS_F32) and pool; 0: bfloat16 */
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

/* Scratch rows of one step, carved from one allocation. */
typedef struct {
    uint16_t *x, *qkv, *attn, *tmp, *gate_up, *act;
    float *qf, *of;
} scratch_t;

static void *carve(char **p, int64_t bytes) {
    void *r = *p;
    *p += (bytes + 63) & ~(int64_t)63;
    return r;
}

static int one_layer(const stack_t *s, const layer_t *l, uint16_t *h, const scratch_t *b) {
    const int64_t R = s->rows, Hd = s->hidden, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D;
    const int64_t qkv_w = qs + 2 * kvs;
    pdserve_rms_norm(h, Hd, (const void *)l->input_norm, b->x, R, Hd, s->eps, 1, 1);
    if (matmul(s, l->qkv_kind, b->x, l->qkv, l->qkv_scale, l->qkv_bias, b->qkv, Hd, qkv_w)) return -2;
    pdserve_rope(b->qkv, qkv_w, s->positions, s->cos, s->sin, R, s->heads, D, 1, 1);
    pdserve_rope(b->qkv + qs, qkv_w, s->positions, s->cos, s->sin, R, s->kv_heads, D, 1, 1);
    pdserve_store_kv((void *)l->kv_base, s->page_stride, s->v_off, s->tok_stride, s->P, s->slots, b->qkv + qs, qkv_w,
                     b->qkv + qs + kvs, qkv_w, R, kvs, 2);
    for (int64_t r = 0; r < R; r++) /* the kernel reads float32 queries */
        for (int64_t i = 0; i < qs; i++) b->qf[r * qs + i] = bf16_to_f32(b->qkv[r * qkv_w + i]);
    pdserve_paged_decode(b->qf, (const void *)l->kv_base, 1, s->table, s->table_stride, s->lo, s->hi, b->of, R,
                         s->heads, s->kv_heads, D, s->P, s->page_stride, s->v_off, s->tok_stride, s->head_stride,
                         s->scale, (int)s->attn_threads, (int)s->attn_prefetch, 1, 0.0f);
    for (int64_t i = 0; i < R * qs; i++) b->attn[i] = f32_to_bf16(b->of[i]);
    if (matmul(s, l->o_kind, b->attn, l->o, l->o_scale, 0, b->tmp, qs, Hd)) return -2;
    pdserve_add_rms_norm(h, b->tmp, (const void *)l->post_norm, b->x, R, Hd, s->eps, 1, 1);
    if (matmul(s, l->gate_up_kind, b->x, l->gate_up, l->gate_up_scale, 0, b->gate_up, Hd, 2 * s->inter)) return -2;
    pdserve_silu_mul(b->gate_up, b->act, R, s->inter, 1, 1);
    if (matmul(s, l->down_kind, b->act, l->down, l->down_scale, 0, b->tmp, s->inter, Hd)) return -2;
    for (int64_t i = 0; i < R * Hd; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(b->tmp[i]));
    return 0;
}

/* ---- float32 layers: the same order over float32 rows (no roundings between the kernels) ---- */
typedef struct {
    float *x, *qkv, *qf, *of, *tmp, *gate_up, *act;
} scratch_f32_t;

static int matmul_f32(const stack_t *s, int64_t kind, const float *x, int64_t w, int64_t bias, float *y, int64_t in,
                      int64_t out) {
    if (kind != PANELS_F32) return -1;
    return pdserve_gemm_panels_f32(x, in, (const float *)w, (const float *)bias, y, s->rows, in, out, (int)s->mm_threads);
}

static int one_layer_f32(const stack_t *s, const layer_t *l, float *h, const scratch_f32_t *b) {
    const int64_t R = s->rows, Hd = s->hidden, D = s->head_dim, qs = s->heads * D, kvs = s->kv_heads * D;
    const int64_t qkv_w = qs + 2 * kvs;
    pdserve_rms_norm(h, Hd, (const void *)l->input_norm, b->x, R, Hd, s->eps, 0, 1);
    if (matmul_f32(s, l->qkv_kind, b->x, l->qkv, l->qkv_bias, b->qkv, Hd, qkv_w)) return -2;
    pdserve_rope(b->qkv, qkv_w, s->positions, s->cos, s->sin, R, s->heads, D, 0, 1);
    pdserve_rope(b->qkv + qs, qkv_w, s->positions, s->cos, s->sin, R, s->kv_heads, D, 0, 1);
    pdserve_store_kv((void *)l->kv_base, s->page_stride, s->v_off, s->tok_stride, s->P, s->slots, b->qkv + qs, qkv_w,
                     b->qkv + qs + kvs, qkv_w, R, kvs, 4);
    for (int64_t r = 0; r < R; r++) memcpy(b->qf + r * qs, b->qkv + r * qkv_w, qs * sizeof(float));
    pdserve_paged_decode(b->qf, (const void *)l->kv_base, 0, s->table, s->table_stride, s->lo, s->hi, b->of, R,
                         s->heads, s->kv_heads, D, s->P, s->page_stride, s->v_off, s->tok_stride, s->head_stride,
                         s->scale, (int)s->attn_threads, (int)s->attn_prefetch, 0, 0.0f);
    if (matmul_f32(s, l->o_kind, b->of, l->o, 0, b->tmp, qs, Hd)) return -2;
    pdserve_add_rms_norm(h, b->tmp, (const void *)l->post_norm, b->x, R, Hd, s->eps, 0, 1);
    if (matmul_f32(s, l->gate_up_kind, b->x, l->gate_up, 0, b->gate_up, Hd, 2 * s->inter)) return -2;
    pdserve_silu_mul(b->gate_up, b->act, R, s->inter, 0, 1);
    if (matmul_f32(s, l->down_kind, b->act, l->down, 0, b->tmp, s->inter, Hd)) return -2;
    for (int64_t i = 0; i < R * Hd; i++) h[i] += b->tmp[i];
    return 0;
}

static int stack_f32(const stack_t *s, float *h) {
    const int64_t R = s->rows, qs = s->heads * s->head_dim, kvs = s->kv_heads * s->head_dim;
    const int64_t widest = s->hidden > qs ? s->hidden : qs;
    const int64_t bytes = 64 * 8 + 4 * R * (widest + (qs + 2 * kvs) + 2 * qs + widest + 3 * s->inter);
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
    int rc = 0;
    for (int64_t i = 0; i < s->num_layers && rc == 0; i++) rc = one_layer_f32(s, s->layers + i, h, &b);
    free(mem);
    return rc;
}

/* h: [rows, hidden] bfloat16 (float32 when s->f32), the residual stream after the embedding; updated
 * in place to the last layer's output (before the final norm). */
int pdserve_decode_stack(const stack_t *s, uint16_t *h) {
    if (s->f32) return stack_f32(s, (float *)h);
    const int64_t R = s->rows, qs = s->heads * s->head_dim, kvs = s->kv_heads * s->head_dim;
    const int64_t widest = s->hidden > qs ? s->hidden : qs;
    const int64_t bytes = 64 * 8 + R * (2 * (widest + (qs + 2 * kvs) + qs + s->hidden + 3 * s->inter) + 4 * 2 * qs);
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
    int rc = 0;
    for (int64_t i = 0; i < s->num_layers && rc == 0; i++) rc = one_layer(s, s->layers + i, h, &b);
    free(mem);
    return rc;
}
