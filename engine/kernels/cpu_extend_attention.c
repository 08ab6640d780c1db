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
    int bf16;
} ext_job_t;

typedef struct {
    float *qt, *kf, *vf, *s, *o; /* Qt [D, R_MAX], K/V [KB, D] widened, S [KB, R_MAX], O [R_MAX, D] */
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

/* Item `item` (counted from the most expensive: the last query block of the last request first). */
static void one_item(const ext_job_t *j, int64_t item, scratch_t *w) {
    item = j->items - 1 - item;
    int64_t b = 0;
    while (j->item_end[b] <= item) b++;
    const int64_t local = item - (b ? j->item_end[b - 1] : 0);
    const int64_t g = j->H / j->Hkv, D = j->D, kh = local % j->Hkv, blk = local / j->Hkv;
    const int64_t t0 = blk * j->qb, nt = j->ext[b] - t0 < j->qb ? j->ext[b] - t0 : j->qb;
    const int64_t rows = nt * g, p0 = j->pos0[b] + t0;
    /* Qt, pre-scaled; pad rows copy the last real row's position (their output is dropped) */
    float pos[R_MAX], lo[R_MAX];
    for (int64_t r = 0; r < R_MAX; r++) {
        const int64_t t = r < rows ? r / g : nt - 1;
        pos[r] = (float)(p0 + t);
        lo[r] = j->window > 0 ? (float)(p0 + t - j->window + 1) : -1.0f;
        if (r < rows) {
            const float *qr = j->q + ((j->qstart[b] + t0 + t) * j->H + kh * g + r % g) * D;
            for (int64_t x = 0; x < D; x++) w->qt[x * R_MAX + r] = qr[x] * j->scale;
        } else {
            for (int64_t x = 0; x < D; x++) w->qt[x * R_MAX + r] = 0.0f;
        }
    }
    vf rpos[NRV], rlo[NRV], m[NRV], l[NRV];
    for (int c = 0; c < NRV; c++) {
        rpos[c] = vld_f32(pos + c * W);
        rlo[c] = vld_f32(lo + c * W);
        m[c] = vbcast(-INFINITY);
        l[c] = (vf){};
    }
    memset(w->o, 0, R_MAX * D * sizeof(float));
    float corr[R_MAX];
    const int64_t kend = p0 + nt;
    int64_t kstart = j->window > 0 ? p0 - j->window + 1 : 0;
    if (kstart < 0) kstart = 0;
    for (int64_t first = kstart; first < kend; first += KB) {
        const int64_t n = kend - first < KB ? kend - first : KB;
        widen_block(j, b, kh, first, n, 0, w->kf);
        widen_block(j, b, kh, first, n, j->v_off, w->vf);
        scores(w->kf, w->qt, w->s, n, D);
        softmax_block(w->s, first, n, rpos, rlo, m, l, corr);
        accumulate(w->o, w->s, w->vf, corr, n, D);
    }
    float inv[R_MAX];
    for (int c = 0; c < NRV; c++) vst_f32(inv + c * W, l[c]);
    for (int64_t r = 0; r < rows; r++) {
        const float den = inv[r] > 0.0f ? 1.0f / inv[r] : 0.0f;
        float *o = j->out + ((j->qstart[b] + t0 + r / g) * j->H + kh * g + r % g) * D;
        for (int64_t x = 0; x < D; x++) o[x] = w->o[r * D + x] * den;
    }
}

static void worker(ext_job_t *j) {
    const int64_t D = j->D;
    float *buf = malloc(sizeof(float) * (size_t)(D * R_MAX + 2 * KB * D + KB * R_MAX + R_MAX * D));
    if (buf == 0) return; /* other threads take the items; if none could, the return code says so */
    scratch_t w = {buf, buf + D * R_MAX, buf + D * R_MAX + KB * D, buf + D * R_MAX + 2 * KB * D,
                   buf + D * R_MAX + 2 * KB * D + KB * R_MAX};
    for (int64_t i; (i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->items;) one_item(j, i, &w);
    free(buf);
}

/* Returns 0, or -1 when the shape is not one this kernel takes (D % 4W, G > R_MAX) or out of memory.
 * q/out [T, H, D] float32 with T = sum(ext); request b's new tokens are q rows [qstart[b], +ext[b]) at
 * absolute positions pos0[b] + i; its keys come through table row b. window <= 0: no window. */
int pdserve_paged_extend(const float *q, const void *kv, int bf16, const int64_t *table, int64_t table_stride,
                         const int64_t *qstart, const int64_t *pos0, const int64_t *ext, float *out, int64_t B,
                         int64_t H, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t v_off,
                         int64_t tok_stride, int64_t head_stride, int64_t window, float scale, int threads) {
    const int64_t g = H / Hkv;
    if (D % (4 * W) != 0 || g > R_MAX || g < 1 || B < 1) return -1;
    const int64_t qb = R_MAX / g;
    int64_t *item_end = malloc(sizeof(int64_t) * (size_t)B);
    if (item_end == 0) return -1;
    int64_t items = 0;
    for (int64_t b = 0; b < B; b++) item_end[b] = items += ((ext[b] + qb - 1) / qb) * Hkv;
    ext_job_t j = {q, kv, table, qstart, pos0, ext, item_end, out, B, H, Hkv, D, P, table_stride, page_stride,
                   v_off, tok_stride, head_stride, window, qb, items, scale, 0, bf16};
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
