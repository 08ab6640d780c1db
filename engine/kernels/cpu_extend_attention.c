/* Paged prefill (extend) attention on the CPU: each request's new tokens attend causally (and inside
 * an optional sliding window) to its keys, prefix and new ones alike, read in place from the
 * page-major KV pool (the new tokens' K/V were stored first). Float32 or bfloat16 pools; the sums
 * are float32.
 *
 * Tiling (flash-attention style): a work item is one (request, kv head, block of QB query tokens).
 * Its R = QB * G query rows (G = query heads per kv head; QB = R_MAX / G, rows padded to R_MAX) are
 * held transposed and pre-scaled (Qt [D, R]), so a score tile S [KB keys, R rows] is a small GEMM:
 * each key element is broadcast against R/W row vectors (register block 4 keys x 3 row vectors).
 * The online softmax then runs on whole row vectors (max, exp, sum over the block's keys), and
 * O [R, D] += P.V with each V row loaded once per 4 rows x 4 vectors of D. The decode kernel's
 * one-row-at-a-time passes reloaded and widened every key once per query token; here a key block is
 * widened once per R rows. Items go out largest first (the last query blocks see the most keys) from
 * an atomic counter to torch's OpenMP workers (see cpu_decode_attention.c).
 *
 * bfloat16 pools on a CPU with AVX512-BF16 (when the caller asks, ``dot_bf16``) take the products in
 * bfloat16 instead (``one_item_dot``): S = K.Qt with ``vdpbf16ps`` on pairs of head dimensions, the
 * keys read in place from the pool (no widening pass), and O += P.V with P rounded to bfloat16 and V
 * re-laid as pairs of keys, as flash attention and the CPU kernels of SGLang and vLLM do. Products
 * are exact, sums float32; Q (pre-scaled) and P carry one bfloat16 rounding each, so the result
 * differs from the float32-math path by ~1e-3 relative. The softmax stays float32.
 *
 * Pool addressing is cpu_decode_attention.c's. Requires D % (4 * W) == 0 and G <= R_MAX (the
 * caller, engine/kernels/cpu_native.py, checks and otherwise uses the per-row kernel).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define KB 64             /* key positions per block */
#define R_MAX (3 * W)     /* query rows per item: 3 row vectors */
#define NRV (R_MAX / W)

typedef struct {
    const float *q; /* [T, H, D] float32, the step's new tokens, request after request */
    const void *kv;
    const int64_t *table, *qstart, *pos0, *ext, *item_end; /* item_end: cumulative items per request */
    float *out;                                             /* [T, H, D] */
    int64_t B, H, Hkv, D, P, table_stride, page_stride, v_off, tok_stride, head_stride, window, qb, items;
    float scale;
    int64_t next;
    int bf16, dot;
    float softcap; /* > 0: scores become softcap * tanh(score / softcap) before the mask (Gemma 2) */
} ext_job_t;

/* Soft-caps the S [n, R_MAX] tile of scaled scores where the job asks for it. */
static void cap_tile(const ext_job_t *j, float *s, int64_t n) {
    if (j->softcap > 0.0f)
        for (int64_t x = 0; x < n * R_MAX; x++) s[x] = j->softcap * tanhf(s[x] / j->softcap);
}

typedef struct {
    float *qt, *kf, *vf, *s, *o; /* Qt [D, R_MAX], K/V [KB, D] widened, S [KB, R_MAX], O [R_MAX, D] */
    uint32_t *qp, *pp, *vp;      /* bfloat16 pairs (one_item_dot): Q [D/2, R_MAX], P [KB/2, R_MAX], V [KB/2, D] */
} scratch_t;

static inline vf vbcast(float x) { return (vf){} + x; }

static inline vf vselect(vi mask, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* Rows [0, n) of one block of K (or V, at + v_off) from the pool into dst [KB, D] float32; rows
 * [n, n4) zero (n4: n rounded up to 4; they are masked: past every row's position). */
static void widen_block(const ext_job_t *j, int64_t b, int64_t kh, int64_t first, int64_t n, int64_t v_off,
                        float *dst) {
    const int64_t D = j->D, P = j->P;
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = first + t;
        const int64_t at = j->table[b * j->table_stride + pos / P] * j->page_stride + (pos % P) * j->tok_stride +
                           kh * j->head_stride + v_off;
        float *d = dst + t * D;
        if (j->bf16) {
            const uint16_t *src = (const uint16_t *)j->kv + at;
            for (int64_t x = 0; x < D; x += W) vst_f32(d + x, vld_bf16(src + x));
        } else {
            memcpy(d, (const float *)j->kv + at, D * sizeof(float));
        }
    }
    for (int64_t t = n; t < ((n + 3) & ~(int64_t)3); t++) memset(dst + t * D, 0, D * sizeof(float));
}

/* S [n4, R_MAX] = K [n4, D] . Qt [D, R_MAX] (scores already scaled: Qt is). */
static void scores(const float *kf, const float *qt, float *s, int64_t n, int64_t D) {
    for (int64_t t = 0; t < n; t += 4) {
        vf acc[4][NRV];
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < NRV; c++) acc[k][c] = (vf){};
        const float *k0 = kf + t * D;
        for (int64_t x = 0; x < D; x++) {
            vf qv[NRV];
            for (int c = 0; c < NRV; c++) qv[c] = vld_f32(qt + x * R_MAX + c * W);
            for (int k = 0; k < 4; k++) {
                const vf kb = vbcast(k0[k * D + x]);
                for (int c = 0; c < NRV; c++) acc[k][c] += kb * qv[c];
            }
        }
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < NRV; c++) vst_f32(s + (t + k) * R_MAX + c * W, acc[k][c]);
    }
}

/* Mask, then the online-softmax update of every row vector over this block's keys [first, first + n):
 * S becomes the weights P (0 where masked); m, l are the running max and denominator per row;
 * corr [R_MAX] gets the factor O must be rescaled by. */
static void softmax_block(float *s, int64_t first, int64_t n, const vf *rpos, const vf *rlo, vf *m, vf *l,
                          float *corr) {
    const vf ninf = vbcast(-INFINITY);
    for (int c = 0; c < NRV; c++) {
        vf mb = ninf;
        for (int64_t t = 0; t < n; t++) {
            const vf kpos = vbcast((float)(first + t));
            const vi ok = (kpos <= rpos[c]) & (kpos >= rlo[c]);
            const vf v = vselect(ok, vld_f32(s + t * R_MAX + c * W), ninf);
            vst_f32(s + t * R_MAX + c * W, v);
            mb = vmax(mb, v);
        }
        const vf mn = vmax(m[c], mb);
        const vi live = mn > ninf;               /* rows that have seen a key */
        const vf base = vselect(live, mn, (vf){}); /* no -inf - -inf */
        const vi had = m[c] > ninf;
        const vf cr = vselect(had, vexp(m[c] - base), (vf){});
        vf sum = (vf){};
        for (int64_t t = 0; t < n; t++) {
            const vf v = vld_f32(s + t * R_MAX + c * W);
            const vf p = vselect(v > ninf, vexp(v - base), (vf){});
            vst_f32(s + t * R_MAX + c * W, p);
            sum += p;
        }
        l[c] = l[c] * cr + sum;
        m[c] = mn;
        vst_f32(corr + c * W, cr);
    }
}

/* O [R_MAX, D] = O * corr + P^T . V, with P as S [n, R_MAX] and V [n, D]. */
static void accumulate(float *o, const float *s, const float *vfb, const float *corr, int64_t n, int64_t D) {
    for (int64_t r = 0; r < R_MAX; r += 4) {
        for (int64_t c0 = 0; c0 < D; c0 += 4 * W) {
            vf acc[4][4];
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < 4; c++) acc[k][c] = vld_f32(o + (r + k) * D + c0 + c * W) * corr[r + k];
            for (int64_t t = 0; t < n; t++) {
                vf v[4];
                for (int c = 0; c < 4; c++) v[c] = vld_f32(vfb + t * D + c0 + c * W);
                for (int k = 0; k < 4; k++) {
                    const vf p = vbcast(s[t * R_MAX + r + k]);
                    for (int c = 0; c < 4; c++) acc[k][c] += p * v[c];
                }
            }
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < 4; c++) vst_f32(o + (r + k) * D + c0 + c * W, acc[k][c]);
        }
    }
}

/* Where one work item is: request b, kv head kh, its nt query tokens from t0 (rows = nt * g of them),
 * their absolute positions from p0, and the keys [kstart, kend) they see. */
typedef struct {
    int64_t b, kh, t0, nt, rows, p0, kstart, kend;
} item_t;

/* Item `item` (counted from the most expensive: the last query block of the last request first);
 * fills each row's position and window start (pad rows copy the last real row's: their output is
 * dropped). */
static item_t locate(const ext_job_t *j, int64_t item, float *pos, float *lo) {
    item = j->items - 1 - item;
    item_t it = {0};
    while (j->item_end[it.b] <= item) it.b++;
    const int64_t local = item - (it.b ? j->item_end[it.b - 1] : 0), g = j->H / j->Hkv;
    it.kh = local % j->Hkv;
    it.t0 = (local / j->Hkv) * j->qb;
    it.nt = j->ext[it.b] - it.t0 < j->qb ? j->ext[it.b] - it.t0 : j->qb;
    it.rows = it.nt * g;
    it.p0 = j->pos0[it.b] + it.t0;
    for (int64_t r = 0; r < R_MAX; r++) {
        const int64_t t = r < it.rows ? r / g : it.nt - 1;
        pos[r] = (float)(it.p0 + t);
        lo[r] = j->window > 0 ? (float)(it.p0 + t - j->window + 1) : -1.0f;
    }
    it.kend = it.p0 + it.nt;
    it.kstart = j->window > 0 ? it.p0 - j->window + 1 : 0;
    if (it.kstart < 0) it.kstart = 0;
    return it;
}

/* Query row r of the item (r < rows): its [D] float32 vector in q. */
static const float *q_row(const ext_job_t *j, const item_t *it, int64_t r) {
    const int64_t g = j->H / j->Hkv;
    return j->q + ((j->qstart[it->b] + it->t0 + r / g) * j->H + it->kh * g + r % g) * j->D;
}

/* out rows of the item = O / l (a row that saw no key: 0). */
static void write_rows(const ext_job_t *j, const item_t *it, const float *o, const vf *l) {
    const int64_t g = j->H / j->Hkv, D = j->D;
    float inv[R_MAX];
    for (int c = 0; c < NRV; c++) vst_f32(inv + c * W, l[c]);
    for (int64_t r = 0; r < it->rows; r++) {
        const float den = inv[r] > 0.0f ? 1.0f / inv[r] : 0.0f;
        float *dst = j->out + ((j->qstart[it->b] + it->t0 + r / g) * j->H + it->kh * g + r % g) * D;
        for (int64_t x = 0; x < D; x++) dst[x] = o[r * D + x] * den;
    }
}

static void init_rows(const float *pos, const float *lo, vf *rpos, vf *rlo, vf *m, vf *l) {
    for (int c = 0; c < NRV; c++) {
        rpos[c] = vld_f32(pos + c * W);
        rlo[c] = vld_f32(lo + c * W);
        m[c] = vbcast(-INFINITY);
        l[c] = (vf){};
    }
}

static void one_item(const ext_job_t *j, int64_t item, scratch_t *w) {
    float pos[R_MAX], lo[R_MAX], corr[R_MAX];
    const item_t it = locate(j, item, pos, lo);
    const int64_t D = j->D;
    for (int64_t r = 0; r < R_MAX; r++) { /* Qt, pre-scaled */
        const float *qr = r < it.rows ? q_row(j, &it, r) : 0;
        for (int64_t x = 0; x < D; x++) w->qt[x * R_MAX + r] = qr ? qr[x] * j->scale : 0.0f;
    }
    vf rpos[NRV], rlo[NRV], m[NRV], l[NRV];
    init_rows(pos, lo, rpos, rlo, m, l);
    memset(w->o, 0, R_MAX * D * sizeof(float));
    for (int64_t first = it.kstart; first < it.kend; first += KB) {
        const int64_t n = it.kend - first < KB ? it.kend - first : KB;
        widen_block(j, it.b, it.kh, first, n, 0, w->kf);
        widen_block(j, it.b, it.kh, first, n, j->v_off, w->vf);
        scores(w->kf, w->qt, w->s, n, D);
        cap_tile(j, w->s, n);
        softmax_block(w->s, first, n, rpos, rlo, m, l, corr);
        accumulate(w->o, w->s, w->vf, corr, n, D);
    }
    write_rows(j, &it, w->o, l);
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DOT_AVAILABLE 1

/* The bfloat16 row of key position `pos` (K, or V at + v_off) of request b, kv head kh. */
static inline const uint16_t *kv_row(const ext_job_t *j, int64_t b, int64_t kh, int64_t pos, int64_t v_off) {
    return (const uint16_t *)j->kv + j->table[b * j->table_stride + pos / j->P] * j->page_stride +
           (pos % j->P) * j->tok_stride + kh * j->head_stride + v_off;
}

static inline uint32_t bf16_pair(float a, float b) {
    return (uint32_t)f32_to_bf16(a) | (uint32_t)f32_to_bf16(b) << 16;
}

/* S [n, R_MAX] = K [n, D] . Q: each key's pair of dimensions (one 32-bit word of its pool row) is
 * broadcast against 3 vectors of 16 rows' pairs, 4 keys at a time; keys past n use a zero row. */
static void scores_dot(const ext_job_t *j, const item_t *it, int64_t first, int64_t n, const uint32_t *qp,
                       float *s) {
    static const uint32_t zero[256] = {0};
    const int64_t pairs = j->D / 2;
    for (int64_t t = 0; t < n; t += 4) {
        const uint32_t *kr[4];
        for (int k = 0; k < 4; k++)
            kr[k] = t + k < n ? (const uint32_t *)kv_row(j, it->b, it->kh, first + t + k, 0) : zero;
        __m512 acc[4][NRV];
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < NRV; c++) acc[k][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh qv[NRV];
            for (int c = 0; c < NRV; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qp + p * R_MAX + c * W);
            for (int k = 0; k < 4; k++) {
                const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)kr[k][p]);
                for (int c = 0; c < NRV; c++) acc[k][c] = _mm512_dpbf16_ps(acc[k][c], qv[c], kb);
            }
        }
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < NRV; c++) _mm512_storeu_ps(s + (t + k) * R_MAX + c * W, acc[k][c]);
    }
}

/* softmax_block for the bfloat16-product path, fused with the packing of P: the weights go straight
 * to P [KB/2, R_MAX] pairs (word r of pair row t/2 holds row r's weights of keys t and t + 1, 0 past
 * n). A block no row masks (below the diagonal, inside every window: `masked` 0) skips the masking. */
static void softmax_pack(const float *s, int64_t first, int64_t n, int masked, const vf *rpos, const vf *rlo,
                         vf *m, vf *l, float *corr, uint32_t *pp) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_loadu_si512(order);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < NRV; c++) {
        const __m512 hi = (__m512)rpos[c], lo = (__m512)rlo[c];
        __m512 mb = ninf;
        for (int64_t t = 0; t < n; t++) {
            __m512 v = _mm512_loadu_ps(s + t * R_MAX + c * W);
            if (masked) {
                const __m512 kpos = _mm512_set1_ps((float)(first + t));
                const __mmask16 ok = _mm512_cmp_ps_mask(kpos, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(kpos, lo, _CMP_GE_OQ);
                v = _mm512_mask_blend_ps(ok, ninf, v);
            }
            mb = _mm512_max_ps(mb, v);
        }
        const __m512 old = (__m512)m[c], mn = _mm512_max_ps(old, mb);
        const __mmask16 live = _mm512_cmp_ps_mask(mn, ninf, _CMP_GT_OQ);
        const __m512 base = _mm512_maskz_mov_ps(live, mn);
        const __mmask16 had = _mm512_cmp_ps_mask(old, ninf, _CMP_GT_OQ);
        const __m512 cr = _mm512_maskz_mov_ps(had, exp512(_mm512_sub_ps(old, base)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t += 2) {
            __m512 p[2];
            for (int k = 0; k < 2; k++) {
                if (t + k >= n) {
                    p[k] = _mm512_setzero_ps();
                    continue;
                }
                const __m512 v = _mm512_loadu_ps(s + (t + k) * R_MAX + c * W);
                p[k] = exp512(_mm512_sub_ps(v, base));
                if (masked) {
                    const __m512 kpos = _mm512_set1_ps((float)(first + t + k));
                    const __mmask16 ok = _mm512_cmp_ps_mask(kpos, hi, _CMP_LE_OQ) & _mm512_cmp_ps_mask(kpos, lo, _CMP_GE_OQ);
                    p[k] = _mm512_maskz_mov_ps(ok, p[k]);
                }
                sum = _mm512_add_ps(sum, p[k]);
            }
            const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]); /* words 0-15: key t, 16-31: t + 1 */
            _mm512_storeu_si512(pp + (t / 2) * R_MAX + c * W, _mm512_permutexvar_epi16(idx, h));
        }
        l[c] = (vf)_mm512_fmadd_ps((__m512)l[c], cr, sum);
        m[c] = (vf)mn;
        _mm512_storeu_ps(corr + c * W, cr);
    }
}

/* V [KB/2, D] pairs: word x of pair row t/2 holds dimension x of keys t and t + 1 (zero rows past n). */
static void pack_v(const ext_job_t *j, const item_t *it, int64_t first, int64_t n, uint32_t *vp) {
    static const uint16_t lo_order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t hi_order[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                          24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i il = _mm512_loadu_si512(lo_order), ih = _mm512_loadu_si512(hi_order);
    const int64_t D = j->D;
    for (int64_t t = 0; t < n; t += 2) {
        const uint16_t *r0 = kv_row(j, it->b, it->kh, first + t, j->v_off);
        const uint16_t *r1 = t + 1 < n ? kv_row(j, it->b, it->kh, first + t + 1, j->v_off) : 0;
        uint32_t *dst = vp + (t / 2) * D;
        for (int64_t x = 0; x < D; x += 32) {
            const __m512i a = _mm512_loadu_si512(r0 + x);
            const __m512i b = r1 ? _mm512_loadu_si512(r1 + x) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + x, _mm512_permutex2var_epi16(a, il, b));
            _mm512_storeu_si512(dst + x + 16, _mm512_permutex2var_epi16(a, ih, b));
        }
    }
}

/* O [R_MAX, D] = O * corr + P^T . V over n keys, 4 rows x 4 vectors of D at a time. */
static void accumulate_dot(float *o, const uint32_t *pp, const uint32_t *vp, const float *corr, int64_t n,
                           int64_t D) {
    const int64_t np = (n + 1) / 2;
    for (int64_t r = 0; r < R_MAX; r += 4)
        for (int64_t c0 = 0; c0 < D; c0 += 4 * W) {
            __m512 acc[4][4];
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < 4; c++)
                    acc[k][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (r + k) * D + c0 + c * W), _mm512_set1_ps(corr[r + k]));
            for (int64_t t = 0; t < np; t++) {
                __m512bh v[4];
                for (int c = 0; c < 4; c++) v[c] = (__m512bh)_mm512_loadu_si512(vp + t * D + c0 + c * W);
                for (int k = 0; k < 4; k++) {
                    const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[t * R_MAX + r + k]);
                    for (int c = 0; c < 4; c++) acc[k][c] = _mm512_dpbf16_ps(acc[k][c], v[c], p);
                }
            }
            for (int k = 0; k < 4; k++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (r + k) * D + c0 + c * W, acc[k][c]);
        }
}

static void one_item_dot(const ext_job_t *j, int64_t item, scratch_t *w) {
    float pos[R_MAX], lo[R_MAX], corr[R_MAX];
    const item_t it = locate(j, item, pos, lo);
    const int64_t D = j->D;
    for (int64_t r = 0; r < R_MAX; r++) { /* Q pairs, pre-scaled */
        const float *qr = r < it.rows ? q_row(j, &it, r) : 0;
        for (int64_t p = 0; p < D / 2; p++)
            w->qp[p * R_MAX + r] = qr ? bf16_pair(qr[2 * p] * j->scale, qr[2 * p + 1] * j->scale) : 0;
    }
    vf rpos[NRV], rlo[NRV], m[NRV], l[NRV];
    init_rows(pos, lo, rpos, rlo, m, l);
    memset(w->o, 0, R_MAX * D * sizeof(float));
    for (int64_t first = it.kstart; first < it.kend; first += KB) {
        const int64_t n = it.kend - first < KB ? it.kend - first : KB;
        scores_dot(j, &it, first, n, w->qp, w->s);
        cap_tile(j, w->s, n);
        const int masked = first + n - 1 > it.p0 || (j->window > 0 && first < lo[R_MAX - 1]);
        softmax_pack(w->s, first, n, masked, rpos, rlo, m, l, corr, w->pp);
        pack_v(j, &it, first, n, w->vp);
        accumulate_dot(w->o, w->pp, w->vp, corr, n, D);
    }
    write_rows(j, &it, w->o, l);
}
#else
#define DOT_AVAILABLE 0
static void one_item_dot(const ext_job_t *j, int64_t item, scratch_t *w) { one_item(j, item, w); }
#endif

/* 1 when this build has the bfloat16-product path (AVX512-BF16). */
int pdserve_extend_dot_available(void) { return DOT_AVAILABLE; }

static void worker(ext_job_t *j) {
    const int64_t D = j->D;
    const size_t floats = (size_t)(D * R_MAX + 2 * KB * D + KB * R_MAX + R_MAX * D);
    const size_t words = (size_t)(D / 2 * R_MAX + KB / 2 * R_MAX + KB / 2 * D);
    float *buf = malloc(sizeof(float) * floats + sizeof(uint32_t) * words);
    if (buf == 0) return; /* other threads take the items; if none could, the return code says so */
    scratch_t w = {buf, buf + D * R_MAX, buf + D * R_MAX + KB * D, buf + D * R_MAX + 2 * KB * D,
                   buf + D * R_MAX + 2 * KB * D + KB * R_MAX, 0, 0, 0};
    w.qp = (uint32_t *)(buf + floats);
    w.pp = w.qp + D / 2 * R_MAX;
    w.vp = w.pp + KB / 2 * R_MAX;
    const int dot = j->dot && j->bf16 && DOT_AVAILABLE;
    for (int64_t i; (i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->items;) {
        if (dot) one_item_dot(j, i, &w);
        else one_item(j, i, &w);
    }
    free(buf);
}

/* Returns 0, or -1 when the shape is not one this kernel takes (D % 4W, G > R_MAX) or out of memory.
 * q/out [T, H, D] float32 with T = sum(ext); request b's new tokens are q rows [qstart[b], +ext[b]) at
 * absolute positions pos0[b] + i; its keys come through table row b. window <= 0: no window. softcap > 0:
 * scores soft-capped (softcap * tanh(s / softcap)) before the mask; 0: none. dot: take
 * bfloat16 products where the pool is bfloat16 and the build has AVX512-BF16 (see the header). */
int pdserve_paged_extend(const float *q, const void *kv, int bf16, const int64_t *table, int64_t table_stride,
                         const int64_t *qstart, const int64_t *pos0, const int64_t *ext, float *out, int64_t B,
                         int64_t H, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t v_off,
                         int64_t tok_stride, int64_t head_stride, int64_t window, float scale, int threads,
                         int dot, float softcap) {
    const int64_t g = H / Hkv;
    if (D % (4 * W) != 0 || g > R_MAX || g < 1 || B < 1) return -1;
    const int64_t qb = R_MAX / g;
    int64_t *item_end = malloc(sizeof(int64_t) * (size_t)B);
    if (item_end == 0) return -1;
    int64_t items = 0;
    for (int64_t b = 0; b < B; b++) item_end[b] = items += ((ext[b] + qb - 1) / qb) * Hkv;
    ext_job_t j = {q, kv, table, qstart, pos0, ext, item_end, out, B, H, Hkv, D, P, table_stride, page_stride,
                   v_off, tok_stride, head_stride, window, qb, items, scale, 0, bf16, dot, softcap};
    if (threads > 64) threads = 64;
    if (threads > items) threads = (int)items;
    if (threads <= 1) worker(&j);
    else {
#pragma omp parallel num_threads(threads)
        worker(&j);
    }
    free(item_end);
    return j.next >= items ? 0 : -1;
}
