/* Fused per-layer CPU ops: one pass over memory where the torch reference takes several (and as
 * many temporaries). Each reads float32 or bfloat16 (bf16 != 0) and computes in float32; bfloat16
 * results are rounded to nearest-even once. Rows are split across `threads` OpenMP threads (torch's
 * runtime, as for the attention kernel). Built with the other kernels by engine/kernels/cpu_library.py; references in
 * engine/kernels/fused.py.
 *
 *   rms_norm:      out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w          (x rows strided)
 *   rms_norm_f32w: the same with w float32 whatever x's dtype (Gemma's 1 + weight, not rounded)
 *   add_rms_norm:  h[r] += res[r] (rounded to h's dtype), then out[r] = rms_norm(h[r])
 *   rope:          x[t, head] rotated in place by pos[t] (rotate_half convention, tables [P, D])
 *   silu_mul:      out[r, i] = silu(gu[r, i]) * gu[r, inter + i]
 *   gelu_tanh_mul: out[r, i] = gelu_tanh(gu[r, i]) * gu[r, inter + i]   (bfloat16: the GELU rounded
 *                  first, then the product, as torch's two bfloat16 ops)
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* Row conversions: every op reads its row into a float32 buffer and writes it back from one, so
 * each loop below is branch-free and vectorizes (bfloat16 widening is a shift; narrowing rounds to
 * nearest even, NaN kept a quiet NaN). */
static void to_f32(const void *src, int64_t off, float *dst, int64_t n, int bf16) {
    if (!bf16) {
        memcpy(dst, (const float *)src + off, n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src + off;
    uint32_t *u = (uint32_t *)dst;
    for (int64_t i = 0; i < n; i++) u[i] = (uint32_t)h[i] << 16;
}

static void from_f32(const float *src, void *dst, int64_t off, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)dst + off, src, n * sizeof(float));
        return;
    }
    const uint32_t *u = (const uint32_t *)src;
    uint16_t *h = (uint16_t *)dst + off;
    for (int64_t i = 0; i < n; i++) h[i] = bits_to_bf16(u[i]);
}

/* ---- row-parallel driver ---- */
typedef void (*row_fn)(const void *args, int64_t r0, int64_t r1);
typedef struct {
    row_fn fn;
    const void *args;
    int64_t rows, chunk, next;
} par_t;

static void *par_worker(void *arg) {
    par_t *p = (par_t *)arg;
    for (int64_t r; (r = __atomic_fetch_add(&p->next, p->chunk, __ATOMIC_RELAXED)) < p->rows;)
        p->fn(p->args, r, r + p->chunk < p->rows ? r + p->chunk : p->rows);
    return 0;
}

static void par_rows(row_fn fn, const void *args, int64_t rows, int threads) {
    if (threads > 64) threads = 64;
    if (threads < 1 || rows < 2) threads = 1;
    par_t p = {fn, args, rows, rows / (threads * 4) > 0 ? rows / (threads * 4) : 1, 0};
    if (threads == 1) par_worker(&p);
    else {
#pragma omp parallel num_threads(threads)
        par_worker(&p);
    }
}

/* ---- RMSNorm (with the residual add) ---- */
typedef struct {
    void *h;
    const void *x, *res, *w;
    void *out;
    int64_t dim, x_stride;
    float eps;
    int bf16, add, w_f32; /* w_f32: the weight is float32 (else x's dtype) */
} norm_t;

static void norm_rows(const void *a, int64_t r0, int64_t r1) {
    const norm_t *n = (const norm_t *)a;
    const int64_t D = n->dim;
    float buf[D], res[D], w[D];
    to_f32(n->w, 0, w, D, n->w_f32 ? 0 : n->bf16);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t xo = r * n->x_stride;
        to_f32(n->x, xo, buf, D, n->bf16);
        if (n->add) { /* the sum as stored (rounded to h's dtype) is what the norm and the next add read */
            to_f32(n->res, r * D, res, D, n->bf16);
            for (int64_t i = 0; i < D; i++) buf[i] += res[i];
            from_f32(buf, n->h, xo, D, n->bf16);
            to_f32(n->h, xo, buf, D, n->bf16);
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < D; i++) ss += buf[i] * buf[i];
        const float inv = 1.0f / sqrtf(ss / (float)D + n->eps);
        for (int64_t i = 0; i < D; i++) buf[i] = buf[i] * inv * w[i];
        from_f32(buf, n->out, r * D, D, n->bf16);
    }
}

/* out [rows, dim] contiguous; x rows `x_stride` elements apart; w [dim] in x's dtype. */
void pdserve_rms_norm(const void *x, int64_t x_stride, const void *w, void *out, int64_t rows, int64_t dim,
                      float eps, int bf16, int threads) {
    norm_t n = {0, x, 0, w, out, dim, x_stride, eps, bf16, 0, 0};
    par_rows(norm_rows, &n, rows, threads);
}

/* pdserve_rms_norm with a float32 w [dim] whatever x's dtype. */
void pdserve_rms_norm_f32w(const void *x, int64_t x_stride, const float *w, void *out, int64_t rows, int64_t dim,
                           float eps, int bf16, int threads) {
    norm_t n = {0, x, 0, w, out, dim, x_stride, eps, bf16, 0, 1};
    par_rows(norm_rows, &n, rows, threads);
}

/* h [rows, dim] += res [rows, dim] in place, then out = rms_norm(h); all contiguous. */
void pdserve_add_rms_norm(void *h, const void *res, const void *w, void *out, int64_t rows, int64_t dim,
                          float eps, int bf16, int threads) {
    norm_t n = {h, h, res, w, out, dim, dim, eps, bf16, 1, 0};
    par_rows(norm_rows, &n, rows, threads);
}

/* ---- rotary, in place ---- */
typedef struct {
    void *x;
    const int64_t *pos;
    const float *cos, *sin;
    int64_t heads, head_dim, tok_stride;
    int bf16;
} rope_t;

static void rope_rows(const void *a, int64_t t0, int64_t t1) {
    const rope_t *p = (const rope_t *)a;
    const int64_t D = p->head_dim, half = D / 2, n = p->heads * D;
    float x[n], y[n];
    for (int64_t t = t0; t < t1; t++) {
        const float *c = p->cos + p->pos[t] * D, *s = p->sin + p->pos[t] * D;
        to_f32(p->x, t * p->tok_stride, x, n, p->bf16);
        for (int64_t hd = 0; hd < p->heads; hd++) {
            const float *x1 = x + hd * D, *x2 = x1 + half;
            float *y1 = y + hd * D, *y2 = y1 + half;
            for (int64_t i = 0; i < half; i++) {
                y1[i] = x1[i] * c[i] - x2[i] * s[i];
                y2[i] = x2[i] * c[half + i] + x1[i] * s[half + i];
            }
        }
        from_f32(y, p->x, t * p->tok_stride, n, p->bf16);
    }
}

/* x: `tokens` rows `tok_stride` elements apart, each `heads` contiguous heads of `head_dim`;
 * cos/sin float32 [positions, head_dim]; pos int64 [tokens] (caller checks the range). */
void pdserve_rope(void *x, int64_t tok_stride, const int64_t *pos, const float *cos, const float *sin,
                  int64_t tokens, int64_t heads, int64_t head_dim, int bf16, int threads) {
    rope_t p = {x, pos, cos, sin, heads, head_dim, tok_stride, bf16};
    par_rows(rope_rows, &p, tokens, threads);
}

/* ---- SiLU(gate) * up ---- */
typedef struct {
    const void *gu;
    void *out;
    int64_t inter;
    int bf16;
} silu_t;

static void silu_rows(const void *a, int64_t r0, int64_t r1) {
    const silu_t *p = (const silu_t *)a;
    const int64_t I = p->inter;
    float g[I], u[I];
    for (int64_t r = r0; r < r1; r++) {
        to_f32(p->gu, r * 2 * I, g, I, p->bf16);
        to_f32(p->gu, r * 2 * I + I, u, I, p->bf16);
        int64_t i = 0;
        for (; i + W <= I; i += W) { /* sigmoid from e^-|g|, which never overflows */
            const vf gv = vld_f32(g + i), e = vexp(-vabs(gv));
            const vi neg = gv < (vf){};
            vf num = e, one = (vf){} + 1.0f;
            vi nb, ob;
            memcpy(&nb, &num, sizeof nb);
            memcpy(&ob, &one, sizeof ob);
            nb = (nb & neg) | (ob & ~neg);
            memcpy(&num, &nb, sizeof num);
            vst_f32(g + i, gv * (num / (1.0f + e)) * vld_f32(u + i));
        }
        for (; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        from_f32(g, p->out, r * I, I, p->bf16);
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 rows on AVX512-BF16, read and written in place (no float32 row buffers): e^-g from
 * exp512 (clamped, so it never overflows: for g < -87 the weight 1 / (1 + e) is ~1e-38 and the
 * product ~0); 1 / (1 + e) from vrcp14ps and one Newton step (~1e-8 relative). Both stay far below
 * the bfloat16 rounding of the result. */
static inline __m512 silu_fast(__m512 g) {
    const __m512 d = _mm512_add_ps(exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)), _mm512_set1_ps(1.0f));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(g, r);
}

static inline __m512 bf16_load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static void silu_rows_bf16(const void *a, int64_t r0, int64_t r1) {
    const silu_t *p = (const silu_t *)a;
    const int64_t I = p->inter;
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *g = (const uint16_t *)p->gu + r * 2 * I, *u = g + I;
        uint16_t *o = (uint16_t *)p->out + r * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 v = _mm512_mul_ps(silu_fast(bf16_load16(g + i)), bf16_load16(u + i));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(v));
        }
        for (; i < I; i++) {
            uint32_t gb = (uint32_t)g[i] << 16, ub = (uint32_t)u[i] << 16;
            float gf, uf;
            memcpy(&gf, &gb, sizeof gf);
            memcpy(&uf, &ub, sizeof uf);
            o[i] = f32_to_bf16(gf / (1.0f + expf(-gf)) * uf);
        }
    }
}
#endif

/* gu [rows, 2 * inter] (gate then up), out [rows, inter]; contiguous. */
void pdserve_silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int threads) {
    silu_t p = {gu, out, inter, bf16};
#if defined(__AVX512BF16__)
    if (bf16) {
        par_rows(silu_rows_bf16, &p, rows, threads);
        return;
    }
#endif
    par_rows(silu_rows, &p, rows, threads);
}

/* ---- GELU(gate, tanh approximation) * up ---- */

/* 0.5 g (1 + tanh(t)), t = sqrt(2 / pi) (g + 0.044715 g^3), with 1 + tanh(t) = 2 / (1 + e) for t >= 0 and
 * 2 e / (1 + e) for t < 0, e = e^(-2 |t|) from vexp (never overflows; no cancellation where g is very
 * negative): within a few float32 ulps of the exact value. */
static inline vf gelu_tanh(vf g) {
    const vf t = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const vf e = vexp(-2.0f * vabs(t)), one = (vf){} + 1.0f;
    const vi neg = t < (vf){};
    vi eb, ob;
    memcpy(&eb, &e, sizeof eb);
    memcpy(&ob, &one, sizeof ob);
    eb = (eb & neg) | (ob & ~neg);
    vf num;
    memcpy(&num, &eb, sizeof num);
    return g * (num / (1.0f + e));
}

static void gelu_rows(const void *a, int64_t r0, int64_t r1) {
    const silu_t *p = (const silu_t *)a;
    const int64_t I = p->inter;
    float g[I + W], u[I + W];
    for (int64_t r = r0; r < r1; r++) {
        to_f32(p->gu, r * 2 * I, g, I, p->bf16);
        to_f32(p->gu, r * 2 * I + I, u, I, p->bf16);
        for (int64_t i = I; i < I + W; i++) g[i] = u[i] = 0.0f; /* the tail vector's padding */
        for (int64_t i = 0; i < I; i += W) {
            vf y = gelu_tanh(vld_f32(g + i));
            if (p->bf16) { /* torch rounds the GELU to bfloat16 before the product */
                for (int j = 0; j < W; j++) y[j] = bf16_to_f32(f32_to_bf16(y[j]));
            }
            vst_f32(g + i, y * vld_f32(u + i));
        }
        from_f32(g, p->out, r * I, I, p->bf16);
    }
}

/* gu [rows, 2 * inter] (gate then up), out [rows, inter]; contiguous. */
void pdserve_gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16, int threads) {
    silu_t p = {gu, out, inter, bf16};
    par_rows(gelu_rows, &p, rows, threads);
}

/* ---- KV store: each new token's K and V rows into its slot of one layer of the paged pool ---- */

/* kv: the layer's base in the pool (element size `esize`); slot s lands at page s / P, offset s % P:
 * K at kv + page * page_stride + off * tok_stride, V `v_off` elements further. k, v: `tokens` rows of
 * `row` elements, `k_stride` / `v_stride` elements apart (views of a fused QKV row are fine). The
 * caller checks every slot is inside the pool. */
void pdserve_store_kv(void *kv, int64_t page_stride, int64_t v_off, int64_t tok_stride, int64_t P,
                      const int64_t *slots, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                      int64_t tokens, int64_t row, int64_t esize) {
    char *base = (char *)kv;
    for (int64_t t = 0; t < tokens; t++) {
        char *dst = base + ((slots[t] / P) * page_stride + (slots[t] % P) * tok_stride) * esize;
        memcpy(dst, (const char *)k + t * k_stride * esize, row * esize);
        memcpy(dst + v_off * esize, (const char *)v + t * v_stride * esize, row * esize);
    }
}
