/* y = x @ W.T (+ bias) for a few rows of bfloat16 x against a plain [out, in] bfloat16 weight, on
 * cores with AVX512-BF16: the decode-step matmuls of a small batch.
 *
 * Why: at 1-8 rows a layer's matmuls read each weight once and do little arithmetic, so their time
 * should be the weight's bytes over memory bandwidth. oneDNN's packed primitive spends ~15-20 us per
 * call on top of that, more than a small weight's whole read (`python -m benchmarks.gemm_rows`
 * times both).
 *
 * How: each thread takes a contiguous range of output rows (one forward stream through W, which the
 * hardware prefetcher follows; a software prefetch runs ahead of it: `prefetch` 0 puts W's lines
 * PF_L1 bytes ahead into L1, 1 puts them PF_L2 bytes ahead into L2. Which is faster depends on the
 * machine (engine/kernels/decode_prefetch.py times both once per process): where the L1 prefetch
 * gains nothing over none, the L2 one brings the stream close to what a core can read). For RB
 * weight rows at a time every 32-element chunk is loaded once and multiplied into all the x rows
 * (vdpbf16ps: bfloat16 pairs multiplied exactly, summed in float32), so W is read once whatever the
 * row count. The float32 sums (+ bias) are rounded to bfloat16 once (round to nearest even), as
 * oneDNN does.
 *
 * pdserve_gemv_i8w is the same over a weight-only int8 weight (`--weight-dtype int8`): W holds
 * int8 values q with one float32 scale per output row, y = (x . q) * scale[o] + bias. Each chunk of
 * 32 int8 weights is widened to bfloat16 in registers (exact: |q| <= 127), so the products are
 * exact as above and W streams at half the bytes.
 *
 * Contract: in % 32 == 0, rows in 1..MAX_ROWS, x rows x_stride elements apart, y [rows, out]
 * contiguous bfloat16, bias NULL or [out] bfloat16, scale [out] float32. Returns 0, or -1 where this
 * build has no AVX512-BF16 (the caller then keeps oneDNN). Built by engine/kernels/cpu_library.py. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define MAX_ROWS 8
#define PF_L1 2048  /* bytes ahead, prefetch 0 (into L1) */
#define PF_L2 8192  /* bytes ahead, prefetch 1 (into L2) */

int pdserve_gemv_bf16_available(void);

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 32 int8 weights widened to bfloat16, in order: exact (|q| <= 127 needs 7 of bfloat16's 8 bits). */
static inline __m512bh i8x32_to_bf16(const int8_t *p) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __m512bh bf16x32(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512(p); }

/* Output rows [o0, o0 + RB) for R x rows; RB * R accumulators stay in registers. WT is the weight
 * element type, LOAD widens 32 of them to bfloat16; each output is scaled by scale[o] (NULL: 1). */
#define BLOCK(NAME, WT, LOAD, R, RB)                                                                      \
    static void NAME(const uint16_t *x, int64_t xs, const WT *w, const float *scale, const uint16_t *bias, \
                     uint16_t *y, int64_t in, int64_t out, int64_t o0, int prefetch) {                    \
        __m512 acc[R][RB];                                                                               \
        for (int r = 0; r < R; r++)                                                                      \
            for (int k = 0; k < RB; k++) acc[r][k] = _mm512_setzero_ps();                                \
        const WT *wb = w + o0 * in;                                                                      \
        for (int64_t c = 0; c < in; c += 32) {                                                           \
            for (int k = 0; k < RB; k++) {                                                               \
                const char *row = (const char *)(wb + k * in + c);                                       \
                if (prefetch) _mm_prefetch(row + PF_L2, _MM_HINT_T1);                                    \
                else _mm_prefetch(row + PF_L1, _MM_HINT_T0);                                             \
            }                                                                                            \
            __m512bh wv[RB];                                                                             \
            for (int k = 0; k < RB; k++) wv[k] = LOAD(wb + k * in + c);                                  \
            for (int r = 0; r < R; r++) {                                                                \
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * xs + c);                       \
                for (int k = 0; k < RB; k++) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], xv, wv[k]);         \
            }                                                                                            \
        }                                                                                                \
        for (int k = 0; k < RB; k++) { /* whole blocks: out % RB == 0 */                               \
            const float b = bias ? bf16_to_f32(bias[o0 + k]) : 0.0f, s = scale ? scale[o0 + k] : 1.0f;   \
            for (int r = 0; r < R; r++) y[r * out + o0 + k] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][k]) * s + b); \
        }                                                                                                \
    }

/* RB so that R * RB <= 16 accumulators (with RB loads and one x vector: under 32 registers) */
#define BLOCKS_OF(P, WT, LOAD)                                                                            \
    BLOCK(P##1, WT, LOAD, 1, 8) BLOCK(P##2, WT, LOAD, 2, 8) BLOCK(P##3, WT, LOAD, 3, 4)                  \
    BLOCK(P##4, WT, LOAD, 4, 4) BLOCK(P##5, WT, LOAD, 5, 2) BLOCK(P##6, WT, LOAD, 6, 2)                  \
    BLOCK(P##7, WT, LOAD, 7, 2) BLOCK(P##8, WT, LOAD, 8, 2)
BLOCKS_OF(bf16_block_, uint16_t, bf16x32)
BLOCKS_OF(i8_block_, int8_t, i8x32_to_bf16)

typedef void (*block_fn)(const uint16_t *, int64_t, const void *, const float *, const uint16_t *, uint16_t *,
                         int64_t, int64_t, int64_t, int);
#define FN(f) ((block_fn)(f))
static const block_fn BF16_BLOCKS[MAX_ROWS + 1] = {0, FN(bf16_block_1), FN(bf16_block_2), FN(bf16_block_3),
                                                   FN(bf16_block_4), FN(bf16_block_5), FN(bf16_block_6),
                                                   FN(bf16_block_7), FN(bf16_block_8)};
static const block_fn I8_BLOCKS[MAX_ROWS + 1] = {0, FN(i8_block_1), FN(i8_block_2), FN(i8_block_3),
                                                 FN(i8_block_4), FN(i8_block_5), FN(i8_block_6),
                                                 FN(i8_block_7), FN(i8_block_8)};
static const int RBS[MAX_ROWS + 1] = {0, 8, 8, 4, 4, 2, 2, 2, 2};

static int run_blocks(const block_fn *blocks_of, const uint16_t *x, int64_t x_stride, const void *w,
                      const float *scale, const uint16_t *bias, uint16_t *y, int64_t rows, int64_t in,
                      int64_t out, int threads, int prefetch) {
    if (rows < 1 || rows > MAX_ROWS || in % 32 != 0) return -1;
    const block_fn fn = blocks_of[rows];
    const int64_t rb = RBS[rows], blocks = (out + rb - 1) / rb;
    if (out % rb != 0) return -1; /* every block must be whole: the loads would run past W */
    if (threads > 64) threads = 64;
    if (threads < 1 || blocks < 2) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        /* contiguous block ranges: one forward stream through W per thread */
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (blocks + nt - 1) / nt, b0 = id * per, b1 = b0 + per < blocks ? b0 + per : blocks;
        for (int64_t b = b0; b < b1; b++) fn(x, x_stride, w, scale, bias, y, in, out, b * rb, prefetch);
    }
    return 0;
}

int pdserve_gemv_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t rows, int64_t in, int64_t out, int threads, int prefetch) {
    return run_blocks(BF16_BLOCKS, x, x_stride, w, NULL, bias, y, rows, in, out, threads, prefetch);
}

int pdserve_gemv_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale, const uint16_t *bias,
                     uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads, int prefetch) {
    return run_blocks(I8_BLOCKS, x, x_stride, w, scale, bias, y, rows, in, out, threads, prefetch);
}

int pdserve_gemv_bf16_available(void) { return 1; }
#else
int pdserve_gemv_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t rows, int64_t in, int64_t out, int threads, int prefetch) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)threads;
    (void)prefetch;
    return -1;
}

int pdserve_gemv_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale, const uint16_t *bias,
                     uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads, int prefetch) {
    (void)x, (void)x_stride, (void)w, (void)scale, (void)bias, (void)y, (void)rows, (void)in, (void)out;
    (void)threads, (void)prefetch;
    return -1;
}

int pdserve_gemv_bf16_available(void) { return 0; }
#endif
