/* The expert FFNs of one mixture-of-experts layer for one step, all chosen experts in one call.
 *
 * Why: a decode step of an MoE model reads, per sparse layer, the weights of the experts its tokens
 * chose (top-k each; for a batch, the union) and does little arithmetic on them, so its time should
 * be those bytes over memory bandwidth. The torch path runs several ops per chosen expert (two
 * matmuls, the SiLU, the product, the weighted scatter-add), each dispatched and parallelized on its
 * own; this kernel streams each chosen expert's gate/up and down rows once for all its tokens in one
 * parallel region per layer.
 *
 * How: one parallel region, two phases split by a barrier. Phase 1 splits the intermediate rows
 * [0, inter) into one contiguous range per thread; for every chosen expert the thread reads its gate
 * rows and the matching up rows of that range (RB at a time) and multiplies each into all the
 * expert's tokens (NT at a time; past NT the block's rows come back from L1, not memory), writing
 * act = SiLU(gate) * up (float32, or rounded to bfloat16 for bfloat16 weights, as the torch path
 * rounds its matmul outputs). Phase 2 splits the hidden rows [0, hidden) the same way; the thread
 * reads every chosen expert's down rows of its range and adds weight * (act . row) into out, so each
 * out element has one writer (no atomics) and the experts add in the order given (the torch path's
 * order, increasing expert id). bfloat16 weights: with AVX512-BF16 the products are vdpbf16ps
 * (bfloat16 pairs multiplied exactly, summed in float32, as cpu_gemv.c); elsewhere each bfloat16 is
 * widened to float32 and multiplied there. Weight-only int8 experts (--weight-dtype int8): each
 * chunk of 32 int8 weights widened to bfloat16 in registers (exact, as cpu_gemv.c) and each row's
 * sum scaled by its float32 scale; the weights stream at half bfloat16's bytes. Sums are float32 in
 * every case.
 *
 * Contract: x [tokens, hidden] rows x_stride elements apart, in the weights' element type (float32 or
 * bfloat16, as kind says; bfloat16 for int8 weights, whose float32 row scales are gate_up_scale
 * [num_experts, 2 * inter] and down_scale [num_experts, hidden], NULL for the other kinds); gate_up [num_experts, 2 * inter, hidden] (gate rows first) and down
 * [num_experts, hidden, inter] contiguous; experts[a] the a-th chosen expert (increasing), its
 * (token, weight) pairs are pair_tok/pair_w [offsets[a], offsets[a + 1]), one token at most once per
 * expert; act scratch [pairs, inter] of x's element type; out [tokens, hidden] float32,
 * zeroed by the caller, receives the weighted sums. hidden and inter multiples of 32. Returns 0, or -1
 * (nothing written) for a shape outside the contract. Built by engine/kernels/cpu_library.py. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define NT 4 /* tokens per pass */
#define RB 4 /* weight rows per pass */

typedef void (*dots_fn)(const void *const *xr, const void *w, int64_t k, float *res);

/* res[t * RB + r] = x_t . w_r for N token rows xr[t] and RB weight rows of k elements from w, both of
 * element type T, loaded (widened to float32) by LOAD: float32 rows, or bfloat16 rows widened on any
 * x86-64 / vector ISA. */
#define DOTS_LOADED(NAME, N, T, LOAD)                                                         \
    static void NAME(const void *const *xr, const void *wp, int64_t k, float *res) {          \
        const T *w = wp;                                                                      \
        vf acc[N][RB];                                                                        \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) acc[t][r] = (vf){};                                  \
        for (int64_t c = 0; c < k; c += W) {                                                  \
            vf wv[RB];                                                                        \
            for (int r = 0; r < RB; r++) wv[r] = LOAD(w + r * k + c);                         \
            for (int t = 0; t < N; t++) {                                                     \
                const vf xv = LOAD((const T *)xr[t] + c);                                     \
                for (int r = 0; r < RB; r++) acc[t][r] += xv * wv[r];                         \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) res[t * RB + r] = hsum(acc[t][r]);                   \
    }
#define DOTS_F32(NAME, N) DOTS_LOADED(NAME, N, float, vld_f32)
#define DOTS_WIDEN(NAME, N) DOTS_LOADED(NAME, N, uint16_t, vld_bf16)

DOTS_F32(dots_f32_1, 1) DOTS_F32(dots_f32_2, 2) DOTS_F32(dots_f32_3, 3) DOTS_F32(dots_f32_4, 4)
DOTS_WIDEN(dots_widen_1, 1) DOTS_WIDEN(dots_widen_2, 2) DOTS_WIDEN(dots_widen_3, 3) DOTS_WIDEN(dots_widen_4, 4)
static const dots_fn DOTS_F32_N[NT + 1] = {0, dots_f32_1, dots_f32_2, dots_f32_3, dots_f32_4};
static const dots_fn DOTS_BF16_N[NT + 1] = {0, dots_widen_1, dots_widen_2, dots_widen_3, dots_widen_4};

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* bfloat16 rows by vdpbf16ps: 32 elements a step, pairs multiplied exactly, float32 sums. */
#define DOTS_DP(NAME, N)                                                                      \
    static void NAME(const void *const *xr, const void *wp, int64_t k, float *res) {          \
        const uint16_t *w = wp;                                                               \
        __m512 acc[N][RB];                                                                    \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) acc[t][r] = _mm512_setzero_ps();                     \
        for (int64_t c = 0; c < k; c += 32) {                                                 \
            __m512bh wv[RB];                                                                  \
            for (int r = 0; r < RB; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * k + c); \
            for (int t = 0; t < N; t++) {                                                     \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)xr[t] + c); \
                for (int r = 0; r < RB; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]); \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) res[t * RB + r] = _mm512_reduce_add_ps(acc[t][r]);   \
    }
DOTS_DP(dots_dp_1, 1) DOTS_DP(dots_dp_2, 2) DOTS_DP(dots_dp_3, 3) DOTS_DP(dots_dp_4, 4)
static const dots_fn DOTS_DP_N[NT + 1] = {0, dots_dp_1, dots_dp_2, dots_dp_3, dots_dp_4};

/* 32 int8 weights widened to bfloat16 in order: exact (|q| <= 127), as cpu_gemv.c. */
static inline __m512bh i8x32_bf16(const int8_t *p) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* int8 weight rows (unscaled) against bfloat16 token rows: exact products, float32 sums. */
#define DOTS_I8(NAME, N)                                                                      \
    static void NAME(const void *const *xr, const void *wp, int64_t k, float *res) {          \
        const int8_t *w = wp;                                                                 \
        __m512 acc[N][RB];                                                                    \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) acc[t][r] = _mm512_setzero_ps();                     \
        for (int64_t c = 0; c < k; c += 32) {                                                 \
            __m512bh wv[RB];                                                                  \
            for (int r = 0; r < RB; r++) wv[r] = i8x32_bf16(w + r * k + c);                  \
            for (int t = 0; t < N; t++) {                                                     \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)xr[t] + c); \
                for (int r = 0; r < RB; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]); \
            }                                                                                 \
        }                                                                                     \
        for (int t = 0; t < N; t++)                                                           \
            for (int r = 0; r < RB; r++) res[t * RB + r] = _mm512_reduce_add_ps(acc[t][r]);   \
    }
DOTS_I8(dots_i8_1, 1) DOTS_I8(dots_i8_2, 2) DOTS_I8(dots_i8_3, 3) DOTS_I8(dots_i8_4, 4)
static const dots_fn DOTS_I8_N[NT + 1] = {0, dots_i8_1, dots_i8_2, dots_i8_3, dots_i8_4};
int pdserve_moe_dot_available(void) { return 1; }
#else
static const dots_fn *const DOTS_DP_N = DOTS_BF16_N;
static const dots_fn *const DOTS_I8_N = 0; /* int8 experts need AVX512-BF16: the caller keeps torch */
int pdserve_moe_dot_available(void) { return 0; }
#endif

typedef struct {
    const char *x;
    int64_t x_stride;
    const char *gate_up, *down;
    const dots_fn *dots;
    int64_t esz; /* activation (x, act) element size: 4 (float32) or 2 (bfloat16) */
    int64_t wsz; /* weight element size: esz, or 1 (int8) */
    const float *gate_up_scale, *down_scale; /* int8: [E, 2 * inter], [E, hidden]; else NULL */
    const int64_t *experts, *offsets, *pair_tok;
    const float *pair_w;
    char *act;
    float *out;
    int64_t chosen, hidden, inter;
} moe_args;

static float silu(float g) { return g / (1.0f + expf(-g)); }

/* Phase 1 for intermediate rows [i0, i1) of every chosen expert. */
static void gate_up_rows(const moe_args *a, int64_t i0, int64_t i1) {
    const int64_t h = a->hidden, n = a->inter, es = a->esz, ws = a->wsz;
    for (int64_t c = 0; c < a->chosen; c++) {
        const char *wg = a->gate_up + a->experts[c] * 2 * n * h * ws;
        const float *sc = a->gate_up_scale ? a->gate_up_scale + a->experts[c] * 2 * n : 0;
        const int64_t p0 = a->offsets[c], p1 = a->offsets[c + 1];
        for (int64_t i = i0; i < i1; i += RB) {
            for (int64_t p = p0; p < p1; p += NT) {
                const int m = p1 - p < NT ? (int)(p1 - p) : NT;
                const void *xr[NT];
                for (int t = 0; t < m; t++) xr[t] = a->x + a->pair_tok[p + t] * a->x_stride * es;
                float g[NT * RB], u[NT * RB];
                a->dots[m](xr, wg + i * h * ws, h, g);
                a->dots[m](xr, wg + (n + i) * h * ws, h, u);
                for (int t = 0; t < m; t++)
                    for (int r = 0; r < RB; r++) {
                        const float gs = sc ? sc[i + r] : 1.0f, us = sc ? sc[n + i + r] : 1.0f;
                        const float v = silu(g[t * RB + r] * gs) * (u[t * RB + r] * us);
                        const int64_t at = (p + t) * n + i + r;
                        if (es == 4) ((float *)a->act)[at] = v;
                        else ((uint16_t *)a->act)[at] = f32_to_bf16(v);
                    }
            }
        }
    }
}

/* Phase 2 for hidden rows [j0, j1): out[token] += weight * (act . down row), experts in order. */
static void down_rows(const moe_args *a, int64_t j0, int64_t j1) {
    const int64_t h = a->hidden, n = a->inter, es = a->esz, ws = a->wsz;
    for (int64_t c = 0; c < a->chosen; c++) {
        const char *wd = a->down + a->experts[c] * h * n * ws;
        const float *sc = a->down_scale ? a->down_scale + a->experts[c] * h : 0;
        const int64_t p0 = a->offsets[c], p1 = a->offsets[c + 1];
        for (int64_t j = j0; j < j1; j += RB) {
            for (int64_t p = p0; p < p1; p += NT) {
                const int m = p1 - p < NT ? (int)(p1 - p) : NT;
                const void *xr[NT];
                for (int t = 0; t < m; t++) xr[t] = a->act + (p + t) * n * es;
                float y[NT * RB];
                a->dots[m](xr, wd + j * n * ws, n, y);
                for (int t = 0; t < m; t++) {
                    float *o = a->out + a->pair_tok[p + t] * h + j;
                    for (int r = 0; r < RB; r++) o[r] += a->pair_w[p + t] * (y[t * RB + r] * (sc ? sc[j + r] : 1.0f));
                }
            }
        }
    }
}

/* [lo, hi) of `rows` (a multiple of RB) for thread id of nt: contiguous, whole blocks. */
static void share(int64_t rows, int id, int nt, int64_t *lo, int64_t *hi) {
    const int64_t blocks = rows / RB, per = (blocks + nt - 1) / nt;
    const int64_t b0 = id * per < blocks ? id * per : blocks, b1 = b0 + per < blocks ? b0 + per : blocks;
    *lo = b0 * RB, *hi = b1 * RB;
}

/* kind: MOE_F32 (float32), MOE_BF16 (bfloat16; vdpbf16ps where the build has AVX512-BF16),
 * MOE_BF16_WIDEN (bfloat16 widened to float32 on any build: the tests compare the two) or MOE_I8
 * (weight-only int8 experts with float32 row scales, bfloat16 x; AVX512-BF16 only, else -1).
 * MOE_GEMM_BF16 / MOE_GEMM_I8: gate_up and down in cpu_moe_gemm.c's pair-panel layout, run by that
 * kernel (bfloat16 x; -1 without AVX512-BF16), so the decode stack takes it by its kind alone. */
enum { MOE_F32 = 0, MOE_BF16 = 1, MOE_BF16_WIDEN = 2, MOE_I8 = 3, MOE_GEMM_BF16 = 4, MOE_GEMM_I8 = 5 };

int pdserve_moe_gemm(const uint16_t *x, int64_t x_stride, const void *gate_up, const void *down, int i8,
                     const float *gate_up_scale, const float *down_scale, const int64_t *experts,
                     const int64_t *offsets, const int64_t *pair_tok, const float *pair_w, uint16_t *act, float *out,
                     int64_t chosen, int64_t hidden, int64_t inter, int threads);

int pdserve_moe_experts(const void *x, int64_t x_stride, const void *gate_up, const void *down, int kind,
                        const float *gate_up_scale, const float *down_scale, const int64_t *experts, const int64_t *offsets, const int64_t *pair_tok,
                        const float *pair_w, void *act, float *out, int64_t chosen, int64_t hidden, int64_t inter,
                        int threads) {
    if (kind == MOE_GEMM_BF16 || kind == MOE_GEMM_I8)
        return pdserve_moe_gemm(x, x_stride, gate_up, down, kind == MOE_GEMM_I8, gate_up_scale, down_scale, experts,
                                offsets, pair_tok, pair_w, act, out, chosen, hidden, inter, threads);
    if (hidden % 32 != 0 || inter % 32 != 0 || hidden < 32 || inter < 32 || chosen < 0) return -1;
    if (kind < MOE_F32 || kind > MOE_I8 || (kind == MOE_I8 && (!pdserve_moe_dot_available() || !gate_up_scale || !down_scale)))
        return -1;
    const dots_fn *dots = kind == MOE_F32    ? DOTS_F32_N
                          : kind == MOE_BF16 ? DOTS_DP_N
                          : kind == MOE_I8   ? DOTS_I8_N
                                             : DOTS_BF16_N;
    const int64_t es = kind == MOE_F32 ? 4 : 2, ws = kind == MOE_I8 ? 1 : es;
    const float *gus = kind == MOE_I8 ? gate_up_scale : 0, *ds = kind == MOE_I8 ? down_scale : 0;
    const moe_args a = {x,       x_stride, gate_up, down, dots,   es,     ws,   gus, ds, experts, offsets,
                        pair_tok, pair_w,  act,     out,  chosen, hidden, inter};
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t lo, hi;
        share(inter, id, nt, &lo, &hi);
        gate_up_rows(&a, lo, hi);
#pragma omp barrier
        share(hidden, id, nt, &lo, &hi);
        down_rows(&a, lo, hi);
    }
    return 0;
}
