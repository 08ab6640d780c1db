/* Paged decode attention on the CPU: one float32 query token per request against its keys
 * [lo, hi) read in place from the page-major KV pool (no gather, no padding to the longest
 * request), float32 or bfloat16 (widened to float32 as it is read; the sums are float32 either way).
 * Online softmax per block of up to BLK positions (flash-decoding); the g query heads of one KV head share
 * each K/V block while it is in L1. The loop is bound by memory more than by arithmetic: while a block's
 * row pointers are gathered, rows further on are prefetched. Where to, and how far ahead, depends on
 * the machine (`prefetch`, chosen per process by engine/kernels/decode_prefetch.py, which times both
 * on a pool larger than the last-level cache): `prefetch` 0 puts rows 64 positions ahead into L1
 * (prefetcht0: the faster on cores where L2 prefetches slow the loop down), `prefetch` 1 puts rows
 * 8 positions ahead into L2 (prefetcht1: the faster on cores where L1 prefetches of any distance
 * gain nothing over none). Outputs do not depend on it. The
 * scores' horizontal sums are done 16 at a time by one butterfly (same summation order as one at a
 * time). Work items are (request, kv head) pairs taken from an atomic counter by `threads` OpenMP
 * threads. Built with -fopenmp against libgomp.so.1, the runtime torch
 * already loaded, so these are torch's own warm workers, not a second pool fighting it (cpu_library
 * checks that only one libgomp is mapped and otherwise passes one thread).
 *
 * Pool addressing (in elements): token `pos` of request b, kv head kh, layer base `kv`:
 *   kv + table[b * table_stride + pos / P] * page_stride + (pos % P) * tok_stride + kh * head_stride
 * and V is the same address + v_off. head_dim is contiguous. Built by engine/kernels/cpu_library.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLK 64
enum { PREFETCH_L1 = 0, PREFETCH_L2 = 1 };
/* one row's prefetch (the `prefetch` mode's cache level; the locality hint must be a constant) */
#define PREFETCH_ROW(j, p) \
    ((j)->prefetch == PREFETCH_L2 ? __builtin_prefetch((p), 0, 2) : __builtin_prefetch((p), 0, 3))

typedef struct {
    const float *q;
    const void *kv;
    const int64_t *table, *lo, *hi;
    float *out;
    int64_t H, Hkv, D, P, table_stride, page_stride, v_off, tok_stride, head_stride, heads_per_item, items;
    float scale;
    int64_t next;
    int bf16;
    int prefetch;  /* PREFETCH_L1 or PREFETCH_L2 */
    int64_t ahead; /* positions the row prefetch runs ahead: 64 or 8 */
    int dot;       /* bfloat16 pool: products in bfloat16 (ONE_HEAD_DOT) where built */
    float softcap; /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2), before the softmax */
} job_t;

/* The first n scaled scores of a block, soft-capped where the job asks for it. */
static inline void cap_scores(const job_t *j, float *s, int64_t n) {
    if (j->softcap > 0.0f)
        for (int64_t t = 0; t < n; t++) s[t] = j->softcap * tanhf(s[t] / j->softcap);
}

static inline float ld_f32(const float *p, int64_t x) { return p[x]; }

/* bfloat16 is the top half of a float32: widening is a 16-bit shift (vectorizes). */
static inline float ld_bf16(const uint16_t *p, int64_t x) {
    const uint32_t u = (uint32_t)p[x] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One (request, kv head) pair: online softmax over its keys, g query heads at a time. Defined once
 * per element type T with loader LD, so each inner loop is a straight vectorizable loop. */
#define ONE_HEAD(NAME, T, LD)                                                                           \
    static void NAME(const job_t *j, int64_t b, int64_t kh, float *acc, float *m, float *l) {           \
        const int64_t g = j->H / j->Hkv, D = j->D, P = j->P;                                            \
        const float *q = j->q + (b * j->H + kh * g) * D;                                                \
        const T *kv = (const T *)j->kv;                                                                 \
        float s[BLK];                                                                                   \
        for (int64_t pos = j->lo[b], end = j->hi[b]; pos < end;) {                                      \
            const int64_t page = j->table[b * j->table_stride + pos / P], off = pos % P;                \
            int64_t n = P - off;                                                                        \
            if (n > end - pos) n = end - pos;                                                           \
            if (n > BLK) n = BLK;                                                                       \
            const T *kb = kv + page * j->page_stride + off * j->tok_stride + kh * j->head_stride;       \
            const T *vb = kb + j->v_off;                                                                \
            for (int64_t r = 0; r < g; r++) {                                                           \
                const float *qr = q + r * D;                                                            \
                float *ar = acc + r * D, mb = -INFINITY;                                                \
                for (int64_t t = 0; t < n; t++) {                                                       \
                    const T *k = kb + t * j->tok_stride;                                                \
                    float d = 0.0f;                                                                     \
                    _Pragma("omp simd reduction(+ : d)")                                                \
                    for (int64_t x = 0; x < D; x++) d += qr[x] * LD(k, x);                              \
                    s[t] = d * j->scale;                                                                \
                    cap_scores(j, s + t, 1);                                                            \
                    mb = fmaxf(mb, s[t]);                                                               \
                }                                                                                       \
                const float mn = fmaxf(m[r], mb), corr = expf(m[r] - mn);                               \
                l[r] *= corr;                                                                           \
                _Pragma("omp simd")                                                                     \
                for (int64_t x = 0; x < D; x++) ar[x] *= corr;                                          \
                for (int64_t t = 0; t < n; t++) {                                                       \
                    const float p = expf(s[t] - mn);                                                    \
                    const T *v = vb + t * j->tok_stride;                                                \
                    l[r] += p;                                                                          \
                    _Pragma("omp simd")                                                                 \
                    for (int64_t x = 0; x < D; x++) ar[x] += p * LD(v, x);                              \
                }                                                                                       \
                m[r] = mn;                                                                              \
            }                                                                                           \
            pos += n;                                                                                   \
        }                                                                                               \
    }

ONE_HEAD(one_head_f32, float, ld_f32)
ONE_HEAD(one_head_bf16, uint16_t, ld_bf16)

/* ---- Vector path (head_dim a multiple of 16): GCC/clang vector extensions, lowered to AVX-512,
 * AVX2 or SSE by -march=native. A block gathers up to BLK key positions (across pages) first, so the
 * softmax rescale runs once per block, not once per page; exp is a polynomial on whole vectors (the
 * libm call per score cost more than the dot products). */
#include "cpu_vec.h"

/* Sums of 16 vectors in one: lane i = the sum of v[i]'s lanes. A butterfly of 4 levels (shuffle
 * halves, add) costs ~3 ops per vector against ~8 for a horizontal sum each; fed in bit-reversed
 * order, its lanes come out in order. */
static inline vf reduce16(const vf *v) {
    static const int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) {
        const vf x = v[rev[2 * i]], y = v[rev[2 * i + 1]];
        a[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

/* Q.K partial sums (vectors, reduced later) of positions t, t + 1 for the g heads: element-wise
 * loads widened to float32. dv[r * BLK + t] gets head r's vector for position t. */
#define QK_FMA(T, VLD)                                                                                  \
    for (int64_t t = 0; t < n; t += 2) {                                                                \
        vf d0[g], d1[g];                                                                                \
        for (int64_t r = 0; r < g; r++) d0[r] = d1[r] = (vf){};                                         \
        for (int64_t c = 0; c < nv; c++) {                                                              \
            const vf k0 = VLD(kp[t] + c * W), k1 = VLD(kp[t + 1] + c * W);                              \
            for (int64_t r = 0; r < g; r++) {                                                           \
                const vf qv = vld_f32(q + r * D + c * W);                                               \
                d0[r] += qv * k0;                                                                       \
                d1[r] += qv * k1;                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int64_t r = 0; r < g; r++) {                                                               \
            dv[r * BLK + t] = d0[r];                                                                    \
            dv[r * BLK + t + 1] = d1[r];                                                                \
        }                                                                                               \
    }

/* One (request, kv head) pair on the vector path: for each block of up to BLK positions, scores of
 * the G query heads, one online-softmax update per head, then P.V with each V row loaded once for
 * all G heads. acc [G, D], m [G], l [G] are the running output, max and denominator. G is a
 * compile-time constant in the specialized copies (GQA group sizes 1-8), so the G accumulators stay
 * in registers; positions go two at a time so 2G independent FMA chains hide the FMA latency. */
#define ONE_HEAD_VEC(NAME, T, VLD, GEXPR)                                                               \
    static void NAME(const job_t *j, int64_t b, int64_t kh, float *acc, float *m, float *l) {           \
        const int64_t g = (GEXPR), D = j->D, P = j->P, nv = D / W;                                      \
        const float *q = j->q + (b * j->H + kh * g) * D;                                                \
        const T *kv = (const T *)j->kv;                                                                 \
        const T *kp[BLK + 1];                                                                           \
        float s[g * BLK];                                                                               \
        vf dv[g * BLK];                                                                                 \
        for (int64_t pos = j->lo[b], end = j->hi[b]; pos < end;) {                                      \
            int64_t n = 0, pi = pos / P, off = pos % P;                                                 \
            const T *pg = kv + j->table[b * j->table_stride + pi] * j->page_stride + kh * j->head_stride; \
            for (; n < BLK && pos < end; n++, pos++) {                                                  \
                kp[n] = pg + off * j->tok_stride;                                                       \
                if (pos + j->ahead < end) { /* the row `ahead` positions on streams in meanwhile */     \
                    const int64_t fp = pos + j->ahead;                                                  \
                    const T *fr = kv + j->table[b * j->table_stride + fp / P] * j->page_stride +         \
                                  (fp % P) * j->tok_stride + kh * j->head_stride;                       \
                    for (int64_t x = 0; x < D; x += 64 / (int64_t)sizeof(T)) {                          \
                        PREFETCH_ROW(j, fr + x);                                                        \
                        PREFETCH_ROW(j, fr + j->v_off + x);                                             \
                    }                                                                                   \
                }                                                                                       \
                if (pos - j->lo[b] < j->ahead) /* the first rows: nothing ran ahead of them */          \
                    for (int64_t x = 0; x < D; x += 64 / (int64_t)sizeof(T)) {                          \
                        PREFETCH_ROW(j, kp[n] + x);                                                     \
                        PREFETCH_ROW(j, kp[n] + j->v_off + x);                                          \
                    }                                                                                   \
                if (++off == P && pos + 1 < end) {                                                      \
                    off = 0;                                                                            \
                    pg = kv + j->table[b * j->table_stride + ++pi] * j->page_stride + kh * j->head_stride; \
                }                                                                                       \
            }                                                                                           \
            kp[n] = kp[n - 1]; /* odd n: the pair's second row is a harmless repeat, its weight 0 */     \
            QK_FMA(T, VLD)                                                                              \
            for (int64_t r = 0; r < g; r++)                                                             \
                for (int64_t t = 0; t < n; t += W) {                                                    \
                    const vf sc = reduce16(dv + (r * BLK + t)) * j->scale;                              \
                    memcpy(s + r * BLK + t, &sc, sizeof sc);                                            \
                }                                                                                       \
            for (int64_t r = 0; r < g; r++) cap_scores(j, s + r * BLK, n);                              \
            for (int64_t r = 0; r < g; r++) {                                                           \
                float *sr = s + r * BLK, mb = -INFINITY, sum = 0.0f;                                    \
                _Pragma("omp simd reduction(max : mb)")                                                 \
                for (int64_t t = 0; t < n; t++) mb = sr[t] > mb ? sr[t] : mb;                           \
                const float mn = fmaxf(m[r], mb), corr = expf(m[r] - mn);                               \
                for (int64_t t = 0; t < n; t += W) {                                                    \
                    const vf p = vexp(vld_f32(sr + t) - mn);                                            \
                    memcpy(sr + t, &p, sizeof p);                                                       \
                }                                                                                       \
                _Pragma("omp simd reduction(+ : sum)")                                                  \
                for (int64_t t = 0; t < n; t++) sum += sr[t];                                           \
                if (n & 1) sr[n] = 0.0f;                                                                \
                l[r] = l[r] * corr + sum;                                                               \
                m[r] = mn;                                                                              \
                if (corr != 1.0f)                                                                       \
                    for (int64_t c = 0; c < nv; c++) {                                                  \
                        const vf a = vld_f32(acc + r * D + c * W) * corr;                               \
                        memcpy(acc + r * D + c * W, &a, sizeof a);                                      \
                    }                                                                                   \
            }                                                                                           \
            for (int64_t c = 0; c < nv; c++) {                                                          \
                vf a0[g], a1[g];                                                                        \
                for (int64_t r = 0; r < g; r++) {                                                       \
                    a0[r] = vld_f32(acc + r * D + c * W);                                               \
                    a1[r] = (vf){};                                                                     \
                }                                                                                       \
                for (int64_t t = 0; t < n; t += 2) {                                                    \
                    const vf v0 = VLD(kp[t] + j->v_off + c * W), v1 = VLD(kp[t + 1] + j->v_off + c * W); \
                    for (int64_t r = 0; r < g; r++) {                                                   \
                        a0[r] += s[r * BLK + t] * v0;                                                   \
                        a1[r] += s[r * BLK + t + 1] * v1;                                               \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t r = 0; r < g; r++) {                                                       \
                    const vf a = a0[r] + a1[r];                                                         \
                    memcpy(acc + r * D + c * W, &a, sizeof a);                                          \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

#define VEC_PAIR(G)                                                                                     \
    ONE_HEAD_VEC(one_head_vec_f32_##G, float, vld_f32, G)                                               \
    ONE_HEAD_VEC(one_head_vec_bf16_##G, uint16_t, vld_bf16, G)
VEC_PAIR(1)
VEC_PAIR(2)
VEC_PAIR(3)
VEC_PAIR(4)
VEC_PAIR(5)
VEC_PAIR(6)
VEC_PAIR(7)
VEC_PAIR(8)
ONE_HEAD_VEC(one_head_vec_f32_any, float, vld_f32, j->H / j->Hkv)
ONE_HEAD_VEC(one_head_vec_bf16_any, uint16_t, vld_bf16, j->H / j->Hkv)

typedef void (*head_fn)(const job_t *, int64_t, int64_t, float *, float *, float *);
static const head_fn VEC_F32[9] = {one_head_vec_f32_any, one_head_vec_f32_1, one_head_vec_f32_2,
                                   one_head_vec_f32_3, one_head_vec_f32_4, one_head_vec_f32_5,
                                   one_head_vec_f32_6, one_head_vec_f32_7, one_head_vec_f32_8};
static const head_fn VEC_BF16[9] = {one_head_vec_bf16_any, one_head_vec_bf16_1, one_head_vec_bf16_2,
                                    one_head_vec_bf16_3, one_head_vec_bf16_4, one_head_vec_bf16_5,
                                    one_head_vec_bf16_6, one_head_vec_bf16_7, one_head_vec_bf16_8};


/* ---- bfloat16 products (AVX512-BF16; `dot`, bfloat16 pools only) ----------------------------------
 * The float32-math path spends most of its instructions widening bfloat16 keys and values and on
 * FMAs of one product each; vdpbf16ps multiplies 32 bfloat16 pairs into 16 float32 sums in one. Q.K:
 * the query, rounded to bfloat16 once (exact for a bfloat16 model's query), against 32 key elements
 * read in place. P.V: the softmax weights rounded to bfloat16 and V re-laid as pairs of positions
 * (unpacklo/hi of two V rows: lane i of the low half is dimension (i / 4) * 8 + i % 4 of a 32-chunk,
 * of the high half 4 more), so each accumulator lane is one output dimension in that order, put back
 * in order once at the end. Products are exact, sums float32, the softmax (max, exp, denominator)
 * float32: the result differs from the float32-math path by the weights' one bfloat16 rounding
 * (2^-9 relative), as in flash attention and paged_extend's dot path. */
#if defined(__AVX512BF16__)
#define DOT_AVAILABLE 1
#define DOT_DIMS 32 /* bfloat16 elements per vector */

static inline __m512bh bh_load(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }

/* acc [D] of one head from lane order (see above) back to dimension order, in place. */
static void dot_unpermute(float *acc, int64_t D) {
    for (int64_t c = 0; c < D; c += DOT_DIMS) {
        float t[DOT_DIMS];
        for (int i = 0; i < 16; i++) {
            t[(i / 4) * 8 + i % 4] = acc[c + i];
            t[(i / 4) * 8 + 4 + i % 4] = acc[c + 16 + i];
        }
        memcpy(acc + c, t, sizeof t);
    }
}

#define ONE_HEAD_DOT(NAME, GEXPR)                                                                       \
    static void NAME(const job_t *j, int64_t b, int64_t kh, float *acc, float *m, float *l) {           \
        const int64_t g = (GEXPR), D = j->D, P = j->P, nc = D / DOT_DIMS;                               \
        const float *q = j->q + (b * j->H + kh * g) * D;                                                \
        const uint16_t *kv = (const uint16_t *)j->kv;                                                   \
        const uint16_t *kp[BLK + 4];                                                                    \
        float s[g * BLK];                                                                               \
        uint16_t ps[g * (BLK + 4)];                                                                     \
        __m512 dv[g * BLK];                                                                             \
        __m512bh qb[g * nc];                                                                            \
        for (int64_t r = 0; r < g; r++)                                                                 \
            for (int64_t c = 0; c < nc; c++) {                                                          \
                const float *x = q + r * D + c * DOT_DIMS;                                              \
                qb[r * nc + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));      \
            }                                                                                           \
        const int64_t *tb = j->table + b * j->table_stride, hd = kh * j->head_stride;                   \
        const int64_t lo = j->lo[b], end = j->hi[b];                                                    \
        /* two cursors (page index, offset) walk the rows: `pos` and the prefetch `pos + ahead` */      \
        int64_t pi = lo / P, off = lo % P, fpos = lo, fpi = pi, foff = off;                             \
        for (; fpos < end && fpos < lo + j->ahead; fpos++) { /* the first rows: nothing ran ahead */    \
            const uint16_t *r0 = kv + tb[fpi] * j->page_stride + foff * j->tok_stride + hd;             \
            for (int64_t x = 0; x < D; x += 32) {                                                       \
                PREFETCH_ROW(j, r0 + x);                                                                \
                PREFETCH_ROW(j, r0 + j->v_off + x);                                                     \
            }                                                                                           \
            if (++foff == P) foff = 0, fpi++;                                                           \
        }                                                                                               \
        for (int64_t pos = lo; pos < end;) {                                                            \
            int64_t n = 0;                                                                              \
            const uint16_t *pg = kv + tb[pi] * j->page_stride + hd;                                     \
            for (; n < BLK && pos < end; n++, pos++) {                                                  \
                kp[n] = pg + off * j->tok_stride;                                                       \
                if (fpos < end) { /* the row `ahead` positions on streams in meanwhile */               \
                    const uint16_t *fr = kv + tb[fpi] * j->page_stride + foff * j->tok_stride + hd;     \
                    for (int64_t x = 0; x < D; x += 32) {                                               \
                        PREFETCH_ROW(j, fr + x);                                                        \
                        PREFETCH_ROW(j, fr + j->v_off + x);                                             \
                    }                                                                                   \
                    fpos++;                                                                             \
                    if (++foff == P) foff = 0, fpi++;                                                   \
                }                                                                                       \
                if (++off == P) {                                                                       \
                    off = 0;                                                                            \
                    if (pos + 1 < end) pg = kv + tb[++pi] * j->page_stride + hd;                        \
                }                                                                                       \
            }                                                                                           \
            const int64_t n4 = (n + 3) & ~(int64_t)3; /* P.V takes two pairs at a time */               \
            for (int64_t t = n; t < n4; t++) kp[t] = kp[n - 1]; /* repeats, weight 0 */                 \
            for (int64_t t = 0; t < n; t += 2) {                                                        \
                __m512 d0[g], d1[g];                                                                    \
                for (int64_t r = 0; r < g; r++) d0[r] = d1[r] = _mm512_setzero_ps();                    \
                for (int64_t c = 0; c < nc; c++) {                                                      \
                    const __m512bh k0 = bh_load(kp[t] + c * DOT_DIMS), k1 = bh_load(kp[t + 1] + c * DOT_DIMS); \
                    for (int64_t r = 0; r < g; r++) {                                                   \
                        d0[r] = _mm512_dpbf16_ps(d0[r], k0, qb[r * nc + c]);                            \
                        d1[r] = _mm512_dpbf16_ps(d1[r], k1, qb[r * nc + c]);                            \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t r = 0; r < g; r++) {                                                       \
                    dv[r * BLK + t] = d0[r];                                                            \
                    dv[r * BLK + t + 1] = d1[r];                                                        \
                }                                                                                       \
            }                                                                                           \
            for (int64_t r = 0; r < g; r++)                                                             \
                for (int64_t t = 0; t < n; t += W) {                                                    \
                    const vf sc = reduce16((const vf *)(dv + (r * BLK + t))) * j->scale;                \
                    memcpy(s + r * BLK + t, &sc, sizeof sc);                                            \
                }                                                                                       \
            for (int64_t r = 0; r < g; r++) cap_scores(j, s + r * BLK, n);                              \
            for (int64_t r = 0; r < g; r++) {                                                           \
                float *sr = s + r * BLK, mb = -INFINITY, sum = 0.0f;                                    \
                uint16_t *pr = ps + r * (BLK + 4);                                                      \
                _Pragma("omp simd reduction(max : mb)")                                                 \
                for (int64_t t = 0; t < n; t++) mb = sr[t] > mb ? sr[t] : mb;                           \
                const float mn = fmaxf(m[r], mb), corr = expf(m[r] - mn);                               \
                for (int64_t t = 0; t < n; t += W) {                                                    \
                    const vf p = vexp(vld_f32(sr + t) - mn);                                            \
                    memcpy(sr + t, &p, sizeof p);                                                       \
                    const __m256bh pb = _mm512_cvtneps_pbh((__m512)p);                                  \
                    memcpy(pr + t, &pb, sizeof pb);                                                     \
                }                                                                                       \
                _Pragma("omp simd reduction(+ : sum)")                                                  \
                for (int64_t t = 0; t < n; t++) sum += sr[t];                                           \
                for (int64_t t = n; t < n4; t++) pr[t] = 0;                                             \
                l[r] = l[r] * corr + sum;                                                               \
                m[r] = mn;                                                                              \
                if (corr != 1.0f)                                                                       \
                    for (int64_t x = 0; x < D; x += W) {                                                \
                        const vf a = vld_f32(acc + r * D + x) * corr;                                   \
                        memcpy(acc + r * D + x, &a, sizeof a);                                          \
                    }                                                                                   \
            }                                                                                           \
            for (int64_t c = 0; c < nc; c++) {                                                          \
                __m512 lo0[g], hi0[g], lo1[g], hi1[g];                                                  \
                for (int64_t r = 0; r < g; r++) {                                                       \
                    lo0[r] = _mm512_loadu_ps(acc + r * D + c * DOT_DIMS);                               \
                    hi0[r] = _mm512_loadu_ps(acc + r * D + c * DOT_DIMS + 16);                          \
                    lo1[r] = hi1[r] = _mm512_setzero_ps();                                              \
                }                                                                                       \
                for (int64_t t = 0; t < n4; t += 4) {                                                   \
                    const __m512i a0 = _mm512_loadu_si512(kp[t] + j->v_off + c * DOT_DIMS),             \
                                  a1 = _mm512_loadu_si512(kp[t + 1] + j->v_off + c * DOT_DIMS),         \
                                  b0 = _mm512_loadu_si512(kp[t + 2] + j->v_off + c * DOT_DIMS),         \
                                  b1 = _mm512_loadu_si512(kp[t + 3] + j->v_off + c * DOT_DIMS);         \
                    const __m512bh al = (__m512bh)_mm512_unpacklo_epi16(a0, a1),                        \
                                   ah = (__m512bh)_mm512_unpackhi_epi16(a0, a1),                        \
                                   bl = (__m512bh)_mm512_unpacklo_epi16(b0, b1),                        \
                                   bh = (__m512bh)_mm512_unpackhi_epi16(b0, b1);                        \
                    for (int64_t r = 0; r < g; r++) {                                                   \
                        uint32_t w0, w1;                                                                \
                        memcpy(&w0, ps + r * (BLK + 4) + t, sizeof w0);                                 \
                        memcpy(&w1, ps + r * (BLK + 4) + t + 2, sizeof w1);                             \
                        const __m512bh p0 = (__m512bh)_mm512_set1_epi32((int)w0),                       \
                                       p1 = (__m512bh)_mm512_set1_epi32((int)w1);                       \
                        lo0[r] = _mm512_dpbf16_ps(lo0[r], al, p0);                                      \
                        hi0[r] = _mm512_dpbf16_ps(hi0[r], ah, p0);                                      \
                        lo1[r] = _mm512_dpbf16_ps(lo1[r], bl, p1);                                      \
                        hi1[r] = _mm512_dpbf16_ps(hi1[r], bh, p1);                                      \
                    }                                                                                   \
                }                                                                                       \
                for (int64_t r = 0; r < g; r++) {                                                       \
                    _mm512_storeu_ps(acc + r * D + c * DOT_DIMS, _mm512_add_ps(lo0[r], lo1[r]));        \
                    _mm512_storeu_ps(acc + r * D + c * DOT_DIMS + 16, _mm512_add_ps(hi0[r], hi1[r]));   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int64_t r = 0; r < g; r++) dot_unpermute(acc + r * D, D);                                  \
    }

ONE_HEAD_DOT(one_head_dot_1, 1)
ONE_HEAD_DOT(one_head_dot_2, 2)
ONE_HEAD_DOT(one_head_dot_3, 3)
ONE_HEAD_DOT(one_head_dot_4, 4)
ONE_HEAD_DOT(one_head_dot_5, 5)
ONE_HEAD_DOT(one_head_dot_6, 6)
ONE_HEAD_DOT(one_head_dot_7, 7)
ONE_HEAD_DOT(one_head_dot_8, 8)
ONE_HEAD_DOT(one_head_dot_any, j->H / j->Hkv)
static const head_fn DOT[9] = {one_head_dot_any, one_head_dot_1, one_head_dot_2, one_head_dot_3, one_head_dot_4,
                               one_head_dot_5, one_head_dot_6, one_head_dot_7, one_head_dot_8};
#else
#define DOT_AVAILABLE 0
#endif

int pdserve_decode_dot_available(void) { return DOT_AVAILABLE; }

/* The head function for this job: the bfloat16-product path where asked for and built, else the
 * vector path specialized on the group size where there is one. */
static head_fn pick_head(const job_t *j) {
    const int64_t g = j->H / j->Hkv;
#if DOT_AVAILABLE
    if (j->dot && j->bf16 && j->D % DOT_DIMS == 0) return DOT[g <= 8 ? g : 0];
#endif
    if (j->D % W != 0) return j->bf16 ? one_head_bf16 : one_head_f32;
    const head_fn *t = j->bf16 ? VEC_BF16 : VEC_F32;
    return t[g <= 8 ? g : 0];
}


/* Item i covers kv heads [kh0, kh0 + heads_per_item) of one request. */
static void one_item(const job_t *j, int64_t item) {
    const int64_t per = j->heads_per_item, groups = j->Hkv / per;
    const int64_t b = item / groups, kh0 = (item % groups) * per, g = j->H / j->Hkv, D = j->D;
    float acc[g * D], m[g], l[g];
    for (int64_t kh = kh0; kh < kh0 + per; kh++) {
        for (int64_t r = 0; r < g; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        for (int64_t x = 0; x < g * D; x++) acc[x] = 0.0f;
        pick_head(j)(j, b, kh, acc, m, l);
        float *o = j->out + (b * j->H + kh * g) * D;
        for (int64_t r = 0; r < g; r++) {
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int64_t x = 0; x < D; x++) o[r * D + x] = acc[r * D + x] * inv;
        }
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (int64_t i; (i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->items;) one_item(j, i);
    return 0;
}

/* Returns 0. `kv` holds float32 elements when bf16 == 0, bfloat16 ones otherwise; strides are in elements.
 * `dot` != 0: a bfloat16 pool takes its products in bfloat16 where built (pdserve_decode_dot_available).
 * `softcap` > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax; 0: none. */
int pdserve_paged_decode(const float *q, const void *kv, int bf16, const int64_t *table, int64_t table_stride,
                         const int64_t *lo, const int64_t *hi, float *out, int64_t B, int64_t H,
                         int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t v_off,
                         int64_t tok_stride, int64_t head_stride, float scale, int threads,
                         int prefetch, int dot, float softcap) {
    /* whole requests when there are enough to share out (each page is then read once for all
       its heads), else one kv head per item so a small batch still uses every thread */
    const int64_t per = B >= 2 * threads ? Hkv : 1;
    job_t j = {q, kv, table, lo, hi, out, H, Hkv, D, P, table_stride, page_stride, v_off, tok_stride,
               head_stride, per, B * (Hkv / per), scale, 0, bf16, prefetch,
               prefetch == PREFETCH_L2 ? 8 : 64, dot, softcap};
    if (threads > 64) threads = 64;
    if (threads > j.items) threads = (int)j.items;
    if (threads <= 1) worker(&j);
    else {
#pragma omp parallel num_threads(threads)
        worker(&j);
    }
    return 0;
}
