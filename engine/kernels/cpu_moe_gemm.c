/* One mixture-of-experts layer's chosen experts for a large step (a prefill chunk), register-blocked
 * against each expert's weights in cpu_gemm_pairs.c's pair-panel layout, bfloat16 or weight-only int8.
 *
 * Why: cpu_moe.c multiplies each weight row into a few tokens at a time by dot products (a horizontal
 * sum per output and token), right for decode steps where an expert has one or two tokens, but it
 * computes a large step's tokens far below the core's peak. Here each expert's tokens run as a small
 * GEMM: a panel of 64 outputs streams past up to RB rows whose 4 x RB accumulators stay in registers,
 * one vdpbf16ps per 16 outputs, input pair and row, and no horizontal sums.
 *
 * How: one parallel region, two phases split by the barrier of an omp for. Phase 1 takes items
 * (chosen expert, gate panel p) dynamically (experts have uneven token counts); for each row block of
 * the expert's tokens (gathered by pair_tok) it multiplies gate panel p and the matching up panel
 * (inter / 64 + p), applies the int8 row scales, and writes act = SiLU(gate) * up rounded to bfloat16
 * (as cpu_moe.c and the torch path round it). Phase 2 gives each thread whole down panels (64 hidden
 * outputs); it runs every chosen expert's act rows through the panel and adds weight * y into out,
 * experts in the order given, so each out element has one writer (no atomics) and the sum order per
 * element is cpu_moe.c's (increasing expert id). Sums are float32.
 *
 * Contract: x [tokens, hidden] bfloat16, rows x_stride elements apart; gate_up [E][2 * inter / 64]
 * [hidden / 2][4][16][2] (each expert's [2 * inter, hidden], gate rows first, in pair panels) and down
 * [E][hidden / 64][inter / 2][4][16][2], bfloat16 (i8 == 0) or int8 (i8 == 1, with float32 row scales
 * gate_up_scale [E, 2 * inter] and down_scale [E, hidden]); experts[a] the a-th chosen expert, its
 * (token, weight) pairs pair_tok / pair_w [offsets[a], offsets[a + 1]), a token at most once per expert;
 * act scratch [pairs, inter] bfloat16; out [tokens, hidden] float32, zeroed by the caller. hidden and
 * inter multiples of 64. Returns 0, or -1 (nothing written) for a shape outside the contract or a build
 * without AVX512-BF16. Built by engine/kernels/cpu_library.py; the layout by engine.moe. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define PANEL 64 /* outputs per panel */
#define NV 4     /* vectors of 16 outputs per panel */
#define RB 6     /* rows per register block: 24 accumulators + 4 weights + 1 broadcast */
#define PF 4096  /* prefetch distance into L2 along the streaming panel, bytes */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* res[r * 64 + o] = x_r . w_o for R gathered bfloat16 rows xr[r] and one panel's 64 outputs; VB bytes
 * per weight vector (64 bfloat16, 32 int8). */
#define MICRO(NAME, LOAD, VB, R)                                                                       \
    static void NAME(const uint16_t *const *xr, const char *panel, int64_t kpairs, float *res) {       \
        __m512 acc[R][NV];                                                                             \
        for (int r = 0; r < R; r++)                                                                    \
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();                              \
        for (int64_t kp = 0; kp < kpairs; kp++) {                                                      \
            const char *wp = panel + kp * (NV * VB);                                                   \
            for (int c = 0; c < NV * VB / 64; c++) _mm_prefetch(wp + PF + 64 * c, _MM_HINT_T1);        \
            __m512bh w[NV];                                                                            \
            for (int v = 0; v < NV; v++) w[v] = LOAD(wp + v * VB);                                     \
            for (int r = 0; r < R; r++) {                                                              \
                int32_t pair;                                                                          \
                memcpy(&pair, xr[r] + 2 * kp, 4);                                                      \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                 \
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, w[v]);        \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(res + r * PANEL + 16 * v, acc[r][v]);        \
    }
#define MICROS(P, LOAD, VB)                                                                            \
    MICRO(P##1, LOAD, VB, 1) MICRO(P##2, LOAD, VB, 2) MICRO(P##3, LOAD, VB, 3) MICRO(P##4, LOAD, VB, 4) \
    MICRO(P##5, LOAD, VB, 5) MICRO(P##6, LOAD, VB, 6)
MICROS(bf16_rows_, w_bf16, 64)
MICROS(i8_rows_, w_i8, 32)

typedef void (*micro_fn)(const uint16_t *const *, const char *, int64_t, float *);
static const micro_fn BF16[RB + 1] = {0, bf16_rows_1, bf16_rows_2, bf16_rows_3, bf16_rows_4, bf16_rows_5, bf16_rows_6};
static const micro_fn I8[RB + 1] = {0, i8_rows_1, i8_rows_2, i8_rows_3, i8_rows_4, i8_rows_5, i8_rows_6};

typedef struct {
    const uint16_t *x;
    int64_t x_stride;
    const char *gate_up, *down;
    const micro_fn *micro;
    int64_t vb; /* bytes per weight vector: 64 (bfloat16) or 32 (int8) */
    const float *gate_up_scale, *down_scale;
    const int64_t *experts, *offsets, *pair_tok;
    const float *pair_w;
    uint16_t *act;
    float *out;
    int64_t hidden, inter;
} gemm_args;

/* Row block b of `blocks` over n rows, split evenly (8 rows: 4 + 4, not 6 + 2): first row and count. */
static void block_rows(int64_t n, int64_t blocks, int64_t b, int64_t *r0, int *rr) {
    const int64_t base = n / blocks, extra = n % blocks;
    *r0 = b * base + (b < extra ? b : extra), *rr = (int)(base + (b < extra));
}

/* Phase 1, one item: act rows of chosen expert c, intermediate outputs [64 p, 64 p + 64). */
static void gate_up_panel(const gemm_args *a, int64_t c, int64_t p) {
    const int64_t h = a->hidden, n = a->inter, e = a->experts[c], panel_bytes = h / 2 * NV * a->vb;
    const char *wg = a->gate_up + (e * 2 * n / PANEL + p) * panel_bytes, *wu = wg + n / PANEL * panel_bytes;
    const float *sc = a->gate_up_scale ? a->gate_up_scale + e * 2 * n : 0;
    const int64_t p0 = a->offsets[c], rows = a->offsets[c + 1] - p0, blocks = (rows + RB - 1) / RB;
    float g[RB * PANEL], u[RB * PANEL];
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0;
        int rr;
        block_rows(rows, blocks, b, &r0, &rr);
        const uint16_t *xr[RB];
        for (int r = 0; r < rr; r++) xr[r] = a->x + a->pair_tok[p0 + r0 + r] * a->x_stride;
        a->micro[rr](xr, wg, h / 2, g);
        a->micro[rr](xr, wu, h / 2, u);
        for (int r = 0; r < rr; r++) {
            uint16_t *dst = a->act + (p0 + r0 + r) * n + p * PANEL;
            for (int v = 0; v < NV; v++) {
                const int64_t o = p * PANEL + 16 * v;
                __m512 gv = _mm512_loadu_ps(g + r * PANEL + 16 * v), uv = _mm512_loadu_ps(u + r * PANEL + 16 * v);
                if (sc) gv = _mm512_mul_ps(gv, _mm512_loadu_ps(sc + o)), uv = _mm512_mul_ps(uv, _mm512_loadu_ps(sc + n + o));
                /* SiLU(g) = g / (1 + e^-g), as cpu_fused.c's vector SiLU */
                const __m512 one = _mm512_set1_ps(1.0f);
                const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm256_storeu_si256((__m256i *)(dst + 16 * v), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, uv)));
            }
        }
    }
}

/* Phase 2, one item: out[token][64 j + o] += weight * (act row . down row), every chosen expert in order. */
static void down_panel(const gemm_args *a, int64_t chosen, int64_t j) {
    const int64_t h = a->hidden, n = a->inter, panel_bytes = n / 2 * NV * a->vb;
    float y[RB * PANEL];
    for (int64_t c = 0; c < chosen; c++) {
        const int64_t e = a->experts[c];
        const char *wd = a->down + (e * h / PANEL + j) * panel_bytes;
        const float *sc = a->down_scale ? a->down_scale + e * h + j * PANEL : 0;
        const int64_t p0 = a->offsets[c], rows = a->offsets[c + 1] - p0, blocks = (rows + RB - 1) / RB;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0;
            int rr;
            block_rows(rows, blocks, b, &r0, &rr);
            const uint16_t *xr[RB];
            for (int r = 0; r < rr; r++) xr[r] = a->act + (p0 + r0 + r) * n;
            a->micro[rr](xr, wd, n / 2, y);
            for (int r = 0; r < rr; r++) {
                const int64_t pr = p0 + r0 + r;
                const __m512 w = _mm512_set1_ps(a->pair_w[pr]);
                float *o = a->out + a->pair_tok[pr] * h + j * PANEL;
                for (int v = 0; v < NV; v++) {
                    __m512 yv = _mm512_loadu_ps(y + r * PANEL + 16 * v);
                    if (sc) yv = _mm512_mul_ps(yv, _mm512_loadu_ps(sc + 16 * v));
                    _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(w, yv, _mm512_loadu_ps(o + 16 * v)));
                }
            }
        }
    }
}

int pdserve_moe_gemm(const uint16_t *x, int64_t x_stride, const void *gate_up, const void *down, int i8,
                     const float *gate_up_scale, const float *down_scale, const int64_t *experts,
                     const int64_t *offsets, const int64_t *pair_tok, const float *pair_w, uint16_t *act, float *out,
                     int64_t chosen, int64_t hidden, int64_t inter, int threads) {
    if (hidden % PANEL != 0 || inter % PANEL != 0 || hidden < PANEL || inter < PANEL || chosen < 0) return -1;
    if (i8 && (!gate_up_scale || !down_scale)) return -1;
    const gemm_args a = {x,       x_stride, gate_up, down, i8 ? I8 : BF16, i8 ? 32 : 64, i8 ? gate_up_scale : 0,
                         i8 ? down_scale : 0, experts, offsets, pair_tok, pair_w, act, out, hidden, inter};
    const int64_t gate_panels = inter / PANEL, items = chosen * gate_panels, down_panels = hidden / PANEL;
    if (threads > 64) threads = 64;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) gate_up_panel(&a, i / gate_panels, i % gate_panels);
#pragma omp for schedule(static, 1)
        for (int64_t j = 0; j < down_panels; j++) down_panel(&a, chosen, j);
    }
    return 0;
}

int pdserve_moe_gemm_available(void) { return 1; }
#else
int pdserve_moe_gemm(const uint16_t *x, int64_t x_stride, const void *gate_up, const void *down, int i8,
                     const float *gate_up_scale, const float *down_scale, const int64_t *experts,
                     const int64_t *offsets, const int64_t *pair_tok, const float *pair_w, uint16_t *act, float *out,
                     int64_t chosen, int64_t hidden, int64_t inter, int threads) {
    (void)x, (void)x_stride, (void)gate_up, (void)down, (void)i8, (void)gate_up_scale, (void)down_scale;
    (void)experts, (void)offsets, (void)pair_tok, (void)pair_w, (void)act, (void)out, (void)chosen, (void)hidden;
    (void)inter, (void)threads;
    return -1;
}

int pdserve_moe_gemm_available(void) { return 0; }
#endif
