/* Vector helpers shared by the C CPU kernels: GCC/clang vector extensions of W floats, lowered to
 * AVX-512, AVX2 or SSE by -march=native. */
#ifndef PDSERVE_CPU_VEC_H
#define PDSERVE_CPU_VEC_H
#include <stdint.h>
#include <string.h>

#define W 16
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

static inline vf vld_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vld_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float hsum(vf v) {
    vf h = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    h = h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    h = h + __builtin_shufflevector(h, h, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    return h[0] + h[1];
}

/* e^x for x <= 0 (scores minus their running max), Cephes' expf polynomial: ~2 ulp; clamped at
 * -87 (below that the weight is < 1.7e-38 and rounds away in the sums). */
static inline vf vexp(vf x) {
    const vf lo = (vf){} - 87.0f;
    const vi below = x < lo;
    vi xb, lb;
    memcpy(&xb, &x, sizeof x);
    memcpy(&lb, &lo, sizeof lo);
    xb = (xb & ~below) | (lb & below);
    memcpy(&x, &xb, sizeof x);
    vf fx = x * 1.44269504088896341f + 0.5f;
    vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    const vi over = fl > fx; /* truncation rounded a negative up: floor is one less */
    fl = fl - __builtin_convertvector(over & 1, vf);
    const vf r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
    vf y = (vf){} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const vi e = (__builtin_convertvector(fl, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

static inline vf vabs(vf v) {
    vu u;
    memcpy(&u, &v, sizeof u);
    u &= 0x7fffffffu;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline void vst_f32(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* float32 bits -> bfloat16, round to nearest even, a NaN kept a quiet NaN. */
static inline uint16_t bits_to_bf16(uint32_t x) {
    const uint32_t r = (x & 0x7fffffffu) > 0x7f800000u ? x | 0x00400000u : x + 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(r >> 16);
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return bits_to_bf16(x);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x to ~1e-7 relative for x in [-87, 87] (clamped there: no overflow, no denormal): 2^n by
 * vscalefps times a degree-6 Taylor polynomial of 2^f, |f| <= 1/2. Shared by the bfloat16 paths
 * (softmax weights, SiLU), whose results are rounded to bfloat16 next. */
static inline __m512 exp512(__m512 x) {
    const __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
    const __m512 t = _mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.5252734e-5f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.5403530e-4f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#if defined(__AVX512BF16__)
/* One pair-panel weight vector as 32 bfloat16 pairs: bfloat16 as stored, int8 widened (32 bytes ->
 * 32 floats -> bfloat16, exact: every int8 is a bfloat16). Shared by the pair-panel GEMMs. */
static inline __m512bh w_bf16(const char *p) { return (__m512bh)_mm512_loadu_si512(p); }

static inline __m512bh w_i8(const char *p) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif
#endif

#endif
