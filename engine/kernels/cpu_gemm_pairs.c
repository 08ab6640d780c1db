/* y = x @ W.T (+ bias) for up to a few dozen rows of bfloat16 x, on cores with AVX512-BF16, against a
 * weight stored in "pair panels": the decode-step matmuls of small and medium batches.
 *
 * Layout: W [out, in] is cut into panels of 64 outputs; a panel holds, for each pair of inputs
 * (k, k + 1), the 64 outputs' two weights side by side: [out / 64][in / 2][4][16][2]. One 64-byte
 * vector then holds 16 outputs' weights for one input pair, which is what vdpbf16ps multiplies
 * against a broadcast pair of x: every lane accumulates one output, so no horizontal sum is needed
 * (cpu_gemv.c's row-major kernel reduces 16 lanes per output and row, ~half its time at in = 576).
 *
 * How: each thread takes a contiguous range of (panel, row block) items; for a row block of up to 6
 * rows, 6 x 4 accumulators stay in registers while the panel streams past (from memory for the
 * first row block, then from L2: a panel is 64 * in * 2 bytes, 72 KiB at in = 576). Per input
 * pair: 4 weight vectors, one broadcast per row, 4 dot products per row. The float32 sums are
 * scaled (int8), biased and rounded to bfloat16 once (round to nearest even).
 *
 * pdserve_gemm_pairs_i8w: the same over weight-only int8 weights in the same layout (32 bytes per
 * vector, widened to bfloat16 in registers: exact for |q| <= 127), one float32 scale per output.
 *
 * pdserve_gemm_panels_f32: float32 x and weights in panels of 64 outputs without the pairing,
 * [out / 64][in][4][16] (AVX-512F): per input, 4 weight vectors and one FMA per row and vector against
 * the broadcast x, summed in input order (float32 models' decode steps; the stack's float32 layers);
 * without AVX-512F a portable loop of the same sums, for tests (below).
 *
 * Contract: in % 2 == 0, out % 64 == 0, rows >= 1; x rows x_stride elements apart; y [rows, out]
 * contiguous bfloat16; bias NULL or [out] bfloat16; scale [out] float32. Returns 0, or -1 for a
 * shape outside the contract or a build without AVX512-BF16 (the caller then takes another path).
 * Built by engine/kernels/cpu_library.py; the layout by engine/cpu_linear.py's to_pairs. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define PANEL 64 /* outputs per panel */
#define NV 4     /* vectors of 16 outputs per panel */
#define RB 6     /* rows per register block: 24 accumulators + 4 weights + 1 broadcast */
#define PF 8192             /* prefetch distance in bytes (the panel streams forward), into L2: */
#define PF_HINT _MM_HINT_T1 /* a short distance into L1 ran slower at 1-2 rows */
/* Cache lines prefetched per input pair: every line of the pair's vectors, except at 1-2 rows, where
 * half of them (the hardware prefetcher brings the rest; all of them ran 4-8% slower there). At 3-64
 * rows all lines: the later row blocks then have the next panel in L2 when it comes (faster than two
 * lines at 8-64 rows; `python -m benchmarks.gemm_rows` times the kernel by row count). */
#define PFL_STREAM 2

int pdserve_gemm_pairs_available(void);

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* R rows [r0, r0 + R) of one panel (outputs [o0, o0 + 64)); VB bytes per weight vector. */
#define MICRO(NAME, LOAD, VB, R)                                                                           \
    static void NAME(const uint16_t *x, int64_t xs, const char *panel, const char *pf, int pfl, int64_t kpairs, \
                     const float *scale, const uint16_t *bias, uint16_t *y, int64_t out, int64_t o0) {     \
        __m512 acc[R][NV];                                                                                 \
        for (int r = 0; r < R; r++)                                                                        \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();                                  \
        for (int64_t kp = 0; kp < kpairs; kp++) {                                                          \
            const char *wp = panel + kp * (NV * VB);                                                       \
            const char *pp = pf + kp * (NV * VB);                                                          \
            for (int c = 0; c < pfl; c++) _mm_prefetch(pp + 64 * c, PF_HINT);                              \
            __m512bh w[NV];                                                                                \
            for (int v = 0; v < NV; v++) w[v] = LOAD(wp + v * VB);                                         \
            for (int r = 0; r < R; r++) {                                                                  \
                int32_t pair;                                                                              \
                memcpy(&pair, x + r * xs + 2 * kp, 4);                                                     \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                     \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, w[v]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int v = 0; v < NV; v++) {                                                                     \
            const int64_t o = o0 + 16 * v;                                                                 \
            const __m512 s = scale ? _mm512_loadu_ps(scale + o) : _mm512_set1_ps(1.0f);                    \
            const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(                                 \
                                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + o))), 16)) \
                                  : _mm512_setzero_ps();                                                   \
            for (int r = 0; r < R; r++)                                                                    \
                _mm256_storeu_si256((__m256i *)(y + r * out + o),                                          \
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][v], s, b)));        \
        }                                                                                                  \
    }

#define MICROS(P, LOAD, VB)                                                                                \
    MICRO(P##1, LOAD, VB, 1) MICRO(P##2, LOAD, VB, 2) MICRO(P##3, LOAD, VB, 3) MICRO(P##4, LOAD, VB, 4)     \
    MICRO(P##5, LOAD, VB, 5) MICRO(P##6, LOAD, VB, 6)
MICROS(bf16_rows_, w_bf16, 64)
MICROS(i8_rows_, w_i8, 32)

typedef void (*micro_fn)(const uint16_t *, int64_t, const char *, const char *, int, int64_t, const float *,
                         const uint16_t *, uint16_t *, int64_t, int64_t);
static const micro_fn BF16[RB + 1] = {0, bf16_rows_1, bf16_rows_2, bf16_rows_3, bf16_rows_4, bf16_rows_5, bf16_rows_6};
static const micro_fn I8[RB + 1] = {0, i8_rows_1, i8_rows_2, i8_rows_3, i8_rows_4, i8_rows_5, i8_rows_6};

static int run(const micro_fn *micro, int64_t vb, const uint16_t *x, int64_t xs, const void *w, const float *scale,
               const uint16_t *bias, uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads) {
    if (rows < 1 || in % 2 != 0 || out % PANEL != 0 || in < 2) return -1;
    const int64_t kpairs = in / 2, panel_bytes = kpairs * NV * vb, panels = out / PANEL;
    const int64_t blocks = (rows + RB - 1) / RB, items = panels * blocks;
    if (threads > 64) threads = 64;
    if (threads < 1 || items < 2) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        /* contiguous item ranges, panel-major: a thread's row blocks of one panel reuse it from L2 */
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (items + nt - 1) / nt, i0 = id * per, i1 = i0 + per < items ? i0 + per : items;
        for (int64_t i = i0; i < i1; i++) {
            /* rows split evenly over the blocks (8 rows: 4 + 4, not 6 + 2) */
            const int64_t p = i / blocks, b = i % blocks, base = rows / blocks, extra = rows % blocks;
            const int64_t r0 = b * base + (b < extra ? b : extra), R = base + (b < extra);
            const char *panel = (const char *)w + p * panel_bytes;
            /* the first block streams its panel from memory (prefetching PF ahead); later blocks read it
               from L2 and prefetch the next panel meanwhile, so memory never waits on their compute */
            const char *pf = b == 0 ? panel + PF : (p + 1 < panels ? panel + panel_bytes : panel);
            micro[R](x + r0 * xs, xs, panel, pf, rows < 3 ? PFL_STREAM : (int)(NV * vb / 64), kpairs, scale, bias,
                     y + r0 * out, out, p * PANEL);
        }
    }
    return 0;
}

int pdserve_gemm_pairs_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                            int64_t rows, int64_t in, int64_t out, int threads) {
    return run(BF16, 64, x, x_stride, w, NULL, bias, y, rows, in, out, threads);
}

int pdserve_gemm_pairs_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale,
                           const uint16_t *bias, uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads) {
    return run(I8, 32, x, x_stride, w, scale, bias, y, rows, in, out, threads);
}

int pdserve_gemm_pairs_available(void) { return 1; }
#else
int pdserve_gemm_pairs_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                            int64_t rows, int64_t in, int64_t out, int threads) {
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)threads;
    return -1;
}

int pdserve_gemm_pairs_i8w(const uint16_t *x, int64_t x_stride, const int8_t *w, const float *scale,
                           const uint16_t *bias, uint16_t *y, int64_t rows, int64_t in, int64_t out, int threads) {
    (void)x, (void)x_stride, (void)w, (void)scale, (void)bias, (void)y, (void)rows, (void)in, (void)out;
    (void)threads;
    return -1;
}

int pdserve_gemm_pairs_available(void) { return 0; }
#endif

/* ---- float32 panels (AVX-512F) ---- */
#if defined(__AVX512F__)
#include <immintrin.h>

/* R rows [r0, r0 + R) of one float32 panel (outputs [o0, o0 + 64)); 256 bytes per input. */
#define MICRO_F32(NAME, R)                                                                                 \
    static void NAME(const float *x, int64_t xs, const float *panel, const char *pf, int64_t in,          \
                     const float *bias, float *y, int64_t out, int64_t o0) {                               \
        __m512 acc[R][NV];                                                                                 \
        for (int r = 0; r < R; r++)                                                                        \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();                                  \
        for (int64_t k = 0; k < in; k++) {                                                                 \
            const float *wp = panel + k * (NV * 16);                                                       \
            const char *pp = pf + k * (NV * 64);                                                           \
            for (int c = 0; c < NV; c++) _mm_prefetch(pp + 64 * c, PF_HINT);                               \
            __m512 w[NV];                                                                                  \
            for (int v = 0; v < NV; v++) w[v] = _mm512_loadu_ps(wp + 16 * v);                              \
            for (int r = 0; r < R; r++) {                                                                  \
                const __m512 xb = _mm512_set1_ps(x[r * xs + k]);                                           \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);             \
            }                                                                                              \
        }                                                                                                  \
        for (int v = 0; v < NV; v++) {                                                                     \
            const int64_t o = o0 + 16 * v;                                                                 \
            const __m512 b = bias ? _mm512_loadu_ps(bias + o) : _mm512_setzero_ps();                       \
            for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * out + o, _mm512_add_ps(acc[r][v], b));    \
        }                                                                                                  \
    }
MICRO_F32(f32_rows_1, 1) MICRO_F32(f32_rows_2, 2) MICRO_F32(f32_rows_3, 3) MICRO_F32(f32_rows_4, 4)
MICRO_F32(f32_rows_5, 5) MICRO_F32(f32_rows_6, 6)
typedef void (*micro_f32_fn)(const float *, int64_t, const float *, const char *, int64_t, const float *, float *,
                             int64_t, int64_t);
static const micro_f32_fn F32[RB + 1] = {0, f32_rows_1, f32_rows_2, f32_rows_3, f32_rows_4, f32_rows_5, f32_rows_6};

int pdserve_gemm_panels_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                            int64_t rows, int64_t in, int64_t out, int threads) {
    if (rows < 1 || out % PANEL != 0 || in < 1) return -1;
    const int64_t panel_floats = in * PANEL, panels = out / PANEL;
    const int64_t blocks = (rows + RB - 1) / RB, items = panels * blocks;
    if (threads > 64) threads = 64;
    if (threads < 1 || items < 2) threads = 1;
#pragma omp parallel num_threads(threads)
    {   /* as run() above: contiguous panel-major item ranges, rows split evenly over the blocks */
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (items + nt - 1) / nt, i0 = id * per, i1 = i0 + per < items ? i0 + per : items;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t p = i / blocks, b = i % blocks, base = rows / blocks, extra = rows % blocks;
            const int64_t r0 = b * base + (b < extra ? b : extra), R = base + (b < extra);
            const float *panel = w + p * panel_floats;
            const char *pf = b == 0 ? (const char *)panel + PF
                                    : (const char *)(p + 1 < panels ? panel + panel_floats : panel);
            F32[R](x + r0 * x_stride, x_stride, panel, pf, in, bias, y + r0 * out, out, p * PANEL);
        }
    }
    return 0;
}

int pdserve_gemm_panels_f32_available(void) { return 1; }
#else
#include <math.h>

/* Without AVX-512F: the same sums by plain loops over each panel's 64 outputs (each output's FMAs in
 * input order from 0, then the bias added, as every lane above computes it, so bitwise the same;
 * vectorized by the compiler where the CPU has FMA), one thread. Its _available()
 * stays 0, so engine/cpu_linear.py keeps float32 weights in oneDNN's layout here; tests that need float32
 * panels (and so the float32 decode stack) on such CPUs pack with it (tests/support/cpu_kernels.py). */
int pdserve_gemm_panels_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                            int64_t rows, int64_t in, int64_t out, int threads) {
    if (rows < 1 || out % PANEL != 0 || in < 1) return -1;
    (void)threads; /* one thread: a test path, kept simple */
    for (int64_t p = 0; p < out / PANEL; p++)
        for (int64_t r = 0; r < rows; r++) {
            const float *panel = w + p * in * PANEL, *xr = x + r * x_stride;
            float acc[PANEL] = {0};
            for (int64_t k = 0; k < in; k++)
                for (int j = 0; j < PANEL; j++) acc[j] = fmaf(xr[k], panel[k * PANEL + j], acc[j]);
            for (int j = 0; j < PANEL; j++) y[r * out + p * PANEL + j] = acc[j] + (bias ? bias[p * PANEL + j] : 0.0f);
        }
    return 0;
}

int pdserve_gemm_panels_f32_available(void) { return 0; }
#endif
