/* Attention of a prefill chunk (many query tokens of one sequence) straight from the paged KV pool.
 *
 * Why: torch's SDPA wants K/V as dense tensors, so the runner first gathered the sequence's whole
 * context out of the pool (a copy per layer per chunk), and a chunk after the first needs an
 * explicit mask, under which SDPA computes every masked score too. Here the G query heads of a
 * KV head (GQA/MQA) form the rows of one tile against each block of the context's K/V, copied
 * from the pool's slots once per call, blocks wholly masked (above the causal diagonal, or out of
 * a sliding window) are skipped, and
 * the softmax runs online (flash attention): per row a running max m, sum l and unnormalised
 * output o, rescaled by exp(m_old - m_new) when the max grows.
 *
 * Both products are register-tiled like panel_gemm.c on copies of K and V packed once per call
 * (below): S = Q K^T in tiles of MR rows x 16 positions (q[i, d] broadcast per d), O += P V in
 * tiles of MR rows x 16 dims (P[i, j] broadcast per position).
 *
 * Layouts (contiguous; fp32 but the pool, whose kv_type is fp32, bf16 or fp16: kv_row.h):
 *   q      [T, H, D]          query t is at position first_q + t
 *   k, v   [slots, KVH, D]    the pool; slots[j] holds position first_kv + j, j < n (widened to
 *                             fp32 as they are packed)
 *   out    [T, H, D]
 * Query position x sees kv position p iff p <= x and (window == 0 or p > x - window).
 * Returns 0, or -1 when scratch memory could not be allocated (out is then not written).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kv_row.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#define MR 6  /* rows per register tile: 12 accumulators */
#define BQ 16 /* query positions per task (x G heads = the task's rows) */
#define BK 64 /* kv positions per block */

__m256 _ZGVdN8v_expf(__m256); /* glibc's vector expf (libmvec) */

int prefill_attention_available(void) { return 1; }

static inline int visible(int p, int x, int window) { return p <= x && (window == 0 || p > x - window); }

/* s [mr][BK] = q rows . the 16 positions of kb [D][16] (scaled), rows given by pointers. */
static inline __attribute__((always_inline)) void score_tile(const float *const *qr, const float *kb, int D,
                                                            float scale, float *s, const int mr) {
    __m256 a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const float *col = kb + (size_t)d * 16;
        const __m256 k0 = _mm256_loadu_ps(col), k1 = _mm256_loadu_ps(col + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 x = _mm256_broadcast_ss(qr[i] + d);
            a0[i] = _mm256_fmadd_ps(x, k0, a0[i]);
            a1[i] = _mm256_fmadd_ps(x, k1, a1[i]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(s + (size_t)i * BK, _mm256_mul_ps(a0[i], sc));
        _mm256_storeu_ps(s + (size_t)i * BK + 8, _mm256_mul_ps(a1[i], sc));
    }
}

/* o [mr][D] (row stride D), dims [d0, d0 + 16) += p [mr][BK] (cols < nb) @ vb [nb][16] (those
 * dims of the block's V rows). */
static inline __attribute__((always_inline)) void pv_tile(const float *p, const float *vb, int nb, int d0,
                                                         float *o, int D, const int mr) {
    __m256 a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) {
        a0[i] = _mm256_loadu_ps(o + (size_t)i * D + d0);
        a1[i] = _mm256_loadu_ps(o + (size_t)i * D + d0 + 8);
    }
    for (int j = 0; j < nb; j++) {
        const __m256 v0 = _mm256_loadu_ps(vb + (size_t)j * 16), v1 = _mm256_loadu_ps(vb + (size_t)j * 16 + 8);
        for (int i = 0; i < mr; i++) {
            const __m256 x = _mm256_broadcast_ss(p + (size_t)i * BK + j);
            a0[i] = _mm256_fmadd_ps(x, v0, a0[i]);
            a1[i] = _mm256_fmadd_ps(x, v1, a1[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(o + (size_t)i * D + d0, a0[i]);
        _mm256_storeu_ps(o + (size_t)i * D + d0 + 8, a1[i]);
    }
}

/* One row's scores s [nb] of a block (positions p0 ..) -> probabilities in place, relative to the
 * row's running max m; rescales the row's sum l and output o [D] when the max grows. */
static inline void softmax_row(float *s, int nb, int all_visible, int p0, int x, int window, float *m, float *l,
                               float *o, int D) {
    float mx = *m;
    int any = 0;
    for (int j = 0; j < nb; j++) {
        if (!all_visible && !visible(p0 + j, x, window)) {
            s[j] = -INFINITY;
            continue;
        }
        any = 1;
        if (s[j] > mx) mx = s[j];
    }
    if (!any) { /* nothing in this block is visible to the row */
        memset(s, 0, sizeof(float) * (size_t)nb);
        return;
    }
    const float alpha = *m == -INFINITY ? 0.f : expf(*m - mx);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= nb; j += 8) {
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = 0.f, lanes[8];
    for (; j < nb; j++) {
        s[j] = expf(s[j] - mx);
        total += s[j];
    }
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
    *l = *l * alpha + total;
    *m = mx;
    if (alpha != 1.f)
        for (int d = 0; d < D; d++) o[d] *= alpha;
}

#define CASES(CALL) \
    switch (mr) { \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    case 4: CALL(4); break; \
    case 5: CALL(5); break; \
    default: CALL(MR); break; \
    }

/* One task: query positions [t0, t0 + nt) of KV head h against its visible blocks. Rows are
 * (t, g) pairs, t-major; R = nt * G <= BQ * G. kp: this head's K [np / 16][D][16], vp: its V
 * [D / 16][np][16]. Scratch: s [R][BK], o [R][D], m, l [R], qr [R]. */
static void attend_task(const float *q, const float *kp, const float *vp, int np, float *out, int H, int KVH, int D,
                        int n, int first_kv, int first_q, int window, float scale, int h, int t0, int nt, float *s,
                        float *o, float *m, float *l, const float **qr) {
    const int G = H / KVH, R = nt * G;
    for (int r = 0; r < R; r++) {
        qr[r] = q + ((size_t)(t0 + r / G) * H + h * G + r % G) * D;
        m[r] = -INFINITY, l[r] = 0.f;
    }
    memset(o, 0, sizeof(float) * (size_t)R * D);
    const int xlo = first_q + t0, xhi = first_q + t0 + nt - 1; /* the task's query positions */
    /* kv indices any row sees: positions (xlo - window, xhi] */
    int jlo = window ? xlo - window + 1 - first_kv : 0, jhi = xhi - first_kv + 1;
    if (jlo < 0) jlo = 0;
    if (jhi > n) jhi = n;
    for (int j0 = jlo - jlo % 16; j0 < jhi; j0 += BK) {
        const int nb = jhi - j0 < BK ? jhi - j0 : BK; /* positions of this block */
        for (int r0 = 0; r0 < R; r0 += MR) {
            const int mr = R - r0 < MR ? R - r0 : MR;
            for (int c = 0; c < nb; c += 16) { /* kp is zero-padded to a multiple of 16 */
#define SCORE(MRV) score_tile(qr + r0, kp + (size_t)(j0 + c) * D, D, scale, s + (size_t)r0 * BK + c, MRV)
                CASES(SCORE)
#undef SCORE
            }
        }
        /* wholly visible to every row (no mask): its last position is causal for the first query,
         * its first inside the window of the last */
        const int all_visible = first_kv + j0 + nb - 1 <= xlo && (window == 0 || first_kv + j0 > xhi - window);
        for (int r = 0; r < R; r++)
            softmax_row(s + (size_t)r * BK, nb, all_visible, first_kv + j0, first_q + t0 + r / G, window, &m[r],
                        &l[r], o + (size_t)r * D, D);
        for (int r0 = 0; r0 < R; r0 += MR) {
            const int mr = R - r0 < MR ? R - r0 : MR;
            for (int d0 = 0; d0 < D; d0 += 16) {
#define PV(MRV) pv_tile(s + (size_t)r0 * BK, vp + ((size_t)(d0 / 16) * np + j0) * 16, nb, d0, o + (size_t)r0 * D, D, MRV)
                CASES(PV)
#undef PV
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = out + ((size_t)(t0 + r / G) * H + h * G + r % G) * D;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int d = 0; d < D; d++) dst[d] = o[(size_t)r * D + d] * inv;
    }
}

int prefill_attention(const float *q, const void *k, const void *v, const int64_t *slots, float *out, int T, int H,
                      int KVH, int D, int n, int first_kv, int first_q, int window, float scale, int threads,
                      int kv_type) {
    if (D % 16 || H % KVH || n < 1 || T < 1) return -2;
    const int G = H / KVH, np = (n + 15) & ~15, R = BQ * G;
    const int tiles = (T + BQ - 1) / BQ, tasks = tiles * KVH;
    if (threads < 1) threads = 1;
    /* K and V of the context packed per KV head: kp [np / 16][D][16] (16 positions a panel, so a
     * score tile streams one contiguous panel), vp [D / 16][np][16] (16 dims of consecutive
     * positions); the pool's rows lie 2^k bytes apart, which strided tiles thrash in L1. */
    const size_t per_head = (size_t)np * D;
    float *kp = malloc(sizeof(float) * per_head * KVH), *vp = malloc(sizeof(float) * per_head * KVH);
    const size_t per = (size_t)R * BK + (size_t)R * D + 2 * (size_t)R; /* s, o, m, l */
    float *scratch = malloc(sizeof(float) * per * threads);
    const float **ptrs = malloc(sizeof(float *) * (size_t)R * threads);
    if (!kp || !vp || !scratch || !ptrs) {
        free(kp), free(vp), free(scratch), free(ptrs);
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < np; j++)
        for (int h = 0; h < KVH; h++) {
            float *kd = kp + per_head * h + (size_t)(j / 16) * D * 16 + j % 16;
            float *vd = vp + per_head * h + (size_t)j * 16;
            if (j >= n) { /* padding: zero scores, never read beyond nb */
                for (int d = 0; d < D; d++) kd[(size_t)d * 16] = 0.f;
                continue;
            }
            float krow[D], vrow[D]; /* a 16-bit pool's rows widened to fp32 (kv_row.h) */
            const int64_t off = ((int64_t)slots[j] * KVH + h) * D;
            const float *kr = kv_load_row(k, off, kv_type, D, krow), *vr = kv_load_row(v, off, kv_type, D, vrow);
            for (int d = 0; d < D; d++) kd[(size_t)d * 16] = kr[d];
            for (int d = 0; d < D; d += 16) memcpy(vd + (size_t)(d / 16) * np * 16, vr + d, 16 * sizeof(float));
        }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *s = scratch + per * t, *o = s + (size_t)R * BK, *m = o + (size_t)R * D, *l = m + R;
        const float **qr = ptrs + (size_t)R * t;
        /* Late query tiles see more positions: hand them out first, dynamically. */
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            const int tile = tiles - 1 - task / KVH, h = task % KVH;
            const int t0 = tile * BQ, nt = T - t0 < BQ ? T - t0 : BQ;
            attend_task(q, kp + per_head * h, vp + per_head * h, np, out, H, KVH, D, n, first_kv, first_q, window,
                        scale, h, t0, nt, s, o, m, l, qr);
        }
    }
    free(kp), free(vp), free(scratch), free(ptrs);
    return 0;
}
#else
int prefill_attention_available(void) { return 0; }
int prefill_attention(const float *q, const void *k, const void *v, const int64_t *slots, float *out, int T, int H,
                      int KVH, int D, int n, int first_kv, int first_q, int window, float scale, int threads,
                      int kv_type) {
    (void)q, (void)k, (void)v, (void)slots, (void)out, (void)T, (void)H, (void)KVH, (void)D, (void)n, (void)first_kv,
        (void)first_q, (void)window, (void)scale, (void)threads, (void)kv_type;
    return -2;
}
#endif
