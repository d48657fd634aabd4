/* Random sampling of one token per logits row under temperature, top-k, top-p and min-p, from
 * one uniform draw per row: the token that kvserve/sampling/sampler.py's torch path
 * (filter_logits, then an inverse-CDF draw over the softmax) gives for the same draw.
 *
 * The torch path builds [M, V] temporaries (scaled logits, probabilities, a float64 CDF) and,
 * for top-p over a flat distribution, sorts the whole vocabulary: ~100-200 ms a step for 64 rows
 * of a 262k vocabulary on 2 cores. Here a row costs a few passes over its logits and no sort:
 *
 *   1. m = max(l) / T (division by T > 0 keeps the order), then e_i = exp(l_i / T - m), kept in a
 *      scratch row; with top-k or top-p, a histogram of the tokens by how far below the maximum
 *      they lie (BUCKETS buckets of 1/32 nat, the last one open-ended): count and mass each.
 *      The histogram is ordered as the tokens are (a larger logit never lies in a later bucket).
 *   2. Top-k and top-p cut the tokens, ordered by logit (ties by index), after a prefix. The
 *      buckets say in which bucket each cut falls; only that bucket's tokens are sorted.
 *      Top-k keeps every token tied with the k-th; top-p (over the top-k tokens' renormalised
 *      mass) keeps a token while the mass of those before it is below p. The cut is a logit
 *      `tau` and the index of the last token kept at that logit: a token is kept when its logit
 *      is above tau, or equal with an index no larger. Min-p keeps e_i >= min_p (e of the
 *      maximum is 1).
 *   3. The CDF of the kept masses in vocabulary order, as block sums (BLOCK tokens each, in
 *      double) and a running sum inside the block the draw falls in: the token is the first whose
 *      running sum exceeds u * total; if rounding leaves none, the last kept token.
 *
 * `filtered_probs` stops after step 2 and writes the distribution itself (the kept tokens' e_i
 * over their sum), which speculative decoding's rejection rule reads. A row that holds a NaN or
 * no finite logit is left to the caller, who takes the torch path for it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
__m512 _ZGVeN16v_expf(__m512); /* glibc's vector expf (libmvec) */
#elif defined(__AVX2__) && defined(__FMA__)
__m256 _ZGVdN8v_expf(__m256);
#endif

#define BUCKETS 2048
#define BUCKETS_PER_NAT 32.0f
#define BLOCK 1024

typedef struct {
    float x;   /* the scaled logit */
    int32_t i; /* its token */
    float e;   /* exp(x - m) */
} Cand;

/* The tokens' order: larger logit first, ties by index. */
static int cand_order(const void *a, const void *b) {
    const Cand *p = a, *q = b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->i > q->i) - (p->i < q->i);
}

/* One thread's scratch: x = l / T, e = exp(x - m) and each token's bucket [V]; the block sums;
 * the histogram's four interleaved copies [4][BUCKETS] and their sum [BUCKETS]. */
typedef struct {
    float *x, *e;
    int32_t *bucket;
    double *blocks;
    int *cnt4, *cnt;
    double *mass4, *mass;
} Rows;

/* x[i] = l[i] / t, e[i] = expf(x[i] - m) for every token through one exp routine (the vector one
 * where the CPU has it, the tail too), so that e never orders two tokens otherwise than x.
 * Below EXP_ZERO expf is 0 (exp(-104) < 2^-150 rounds to zero); the vector routine would reach
 * that through its scalar path, lane by lane, which made a row of mostly -inf (the head's screen
 * keeps a top-k row's few logits) 2.7x slower than a full one. */
#define EXP_ZERO -104.0f
static void exp_row(const float *l, float t, float m, float *x, float *e, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) x[i] = l[i] / t;
    int i = 0;
#if defined(__AVX512F__)
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), _mm512_set1_ps(m));
        const __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(EXP_ZERO), _CMP_GE_OQ);
        const __m512 r = live ? _mm512_maskz_mov_ps(live, _ZGVeN16v_expf(_mm512_maskz_mov_ps(live, v)))
                              : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(e + i, k, r);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i < n; i += 8) {
        float buf[8] = {0};
        const int w = n - i >= 8 ? 8 : n - i;
        memcpy(buf, x + i, sizeof(float) * w);
        const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(buf), _mm256_set1_ps(m));
        const __m256 live = _mm256_cmp_ps(v, _mm256_set1_ps(EXP_ZERO), _CMP_GE_OQ);
        const __m256 r = _mm256_movemask_ps(live) ? _mm256_and_ps(live, _ZGVdN8v_expf(_mm256_and_ps(live, v)))
                                                  : _mm256_setzero_ps();
        _mm256_storeu_ps(buf, r);
        memcpy(e + i, buf, sizeof(float) * w);
    }
#else
    for (; i < n; i++) e[i] = x[i] - m >= EXP_ZERO ? expf(x[i] - m) : 0.f;
#endif
}

/* Row maximum of l, or NaN when the row holds a NaN. */
static float row_max(const float *l, int n) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int i = 0; i < n; i++) {
        m = l[i] > m ? l[i] : m;
        nan |= l[i] != l[i];
    }
    return nan ? NAN : m;
}

/* Each token's bucket (how far below the maximum m, in 1/32 nat; monotone in x, -inf last), and
 * the buckets' counts and, `with_mass` (top-p needs them; top-k alone does not), masses
 * (w->cnt, w->mass; masses 0 without). */
static void histogram(const Rows *w, float m, int n, int with_mass) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        const float d = (m - w->x[i]) * BUCKETS_PER_NAT;
        w->bucket[i] = d >= (float)(BUCKETS - 1) ? BUCKETS - 1 : (int32_t)d;
    }
    /* Four interleaved copies, summed at the end: neighbouring tokens often share a bucket, and
     * one copy would chain each increment on the one before through memory. */
    int *c4 = w->cnt4;
    double *m4 = w->mass4;
    memset(c4, 0, sizeof(int) * 4 * BUCKETS);
    memset(m4, 0, sizeof(double) * 4 * BUCKETS);
    int i = 0;
    if (with_mass)
        for (; i + 4 <= n; i += 4)
            for (int j = 0; j < 4; j++) {
                c4[j * BUCKETS + w->bucket[i + j]]++;
                m4[j * BUCKETS + w->bucket[i + j]] += w->e[i + j];
            }
    else
        for (; i + 4 <= n; i += 4)
            for (int j = 0; j < 4; j++) c4[j * BUCKETS + w->bucket[i + j]]++;
    for (; i < n; i++) {
        c4[w->bucket[i]]++;
        m4[w->bucket[i]] += w->e[i];
    }
    for (int b = 0; b < BUCKETS; b++) {
        w->cnt[b] = c4[b] + c4[BUCKETS + b] + c4[2 * BUCKETS + b] + c4[3 * BUCKETS + b];
        w->mass[b] = (m4[b] + m4[BUCKETS + b]) + (m4[2 * BUCKETS + b] + m4[3 * BUCKETS + b]);
    }
}

/* The `count` tokens of bucket b, sorted (larger logit first, ties by index); malloc'd. */
static Cand *bucket_tokens(const Rows *w, int n, int b, int count) {
    Cand *c = malloc(sizeof(Cand) * (count > 0 ? count : 1));
    if (!c) return NULL;
    int i = 0, k = 0;
#if defined(__AVX512F__)
    /* sixteen buckets a compare: a bucket near the top holds a handful of the 262k tokens */
    for (const __m512i vb = _mm512_set1_epi32(b); i + 16 <= n && k < count; i += 16)
        for (__mmask16 hit = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(w->bucket + i), vb); hit; hit &= hit - 1) {
            const int j = i + __builtin_ctz(hit);
            c[k++] = (Cand){w->x[j], j, w->e[j]};
        }
#endif
    for (; i < n && k < count; i++)
        if (w->bucket[i] == b) c[k++] = (Cand){w->x[i], i, w->e[i]};
    qsort(c, count, sizeof(Cand), cand_order);
    return c;
}

typedef struct {
    float tau;     /* tokens with a larger logit are kept */
    int32_t last;  /* of those at tau, the ones with index <= last */
} Cut;

/* Top-k: every token at or above the k-th token's logit. Sets *cut, *kept_mass (their mass) and
 * *bucket (the k-th token's). */
static int top_k_cut(const Rows *w, int n, const int *cnt, const double *mass, int k, Cut *cut, double *kept_mass,
                     int *bucket) {
    int above = 0, b = 0;
    double s = 0.0;
    while (b < BUCKETS - 1 && above + cnt[b] < k) above += cnt[b], s += mass[b], b++;
    Cand *c = bucket_tokens(w, n, b, cnt[b]);
    if (!c) return -1;
    const float kth = c[k - above - 1].x;
    for (int j = 0; j < cnt[b] && c[j].x >= kth; j++) s += c[j].e;
    free(c);
    *cut = (Cut){kth, n};
    *kept_mass = s;
    *bucket = b;
    return 0;
}

/* Top-p over the tokens `cut` keeps (their mass `total`): keep a token while the mass before it
 * is below p * total. Narrows `cut`. `kb` is the top-k cut's bucket (BUCKETS - 1 without one). */
static int top_p_cut(const Rows *w, int n, const int *cnt, const double *mass, float p, double total, int kb,
                     Cut *cut) {
    const double target = (double)p * total;
    double before = 0.0;
    int b = 0;
    while (b < kb && before + mass[b] < target) before += mass[b], b++;
    Cand *c = bucket_tokens(w, n, b, cnt[b]);
    if (!c) return -1;
    int last = -1;
    for (int j = 0; j < cnt[b]; j++) {
        const int in_k = c[j].x > cut->tau || (c[j].x == cut->tau && c[j].i <= cut->last);
        if (!in_k || before >= target) break;
        before += c[j].e;
        last = j;
    }
    if (last >= 0) *cut = (Cut){c[last].x, c[last].i};
    free(c);
    return 0;
}

static inline int kept(float x, float e, int i, Cut cut, float min_p) {
    return (x > cut.tau || (x == cut.tau && i <= cut.last)) && e >= min_p;
}

/* The kept tokens' mass among tokens [lo, hi), in double. */
static double kept_mass(const float *x, const float *e, int lo, int hi, Cut cut, float min_p) {
    double s = 0.0;
    int i = lo;
#if defined(__AVX512F__)
    const __m512 tau = _mm512_set1_ps(cut.tau), mp = _mm512_set1_ps(min_p);
    const __m512i last = _mm512_set1_epi32(cut.last), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                12, 13, 14, 15);
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (; i + 16 <= hi; i += 16) {
        const __m512 vx = _mm512_loadu_ps(x + i), ve = _mm512_loadu_ps(e + i);
        __mmask16 k = _mm512_cmp_ps_mask(vx, tau, _CMP_GT_OQ);
        const __mmask16 tie = _mm512_cmp_ps_mask(vx, tau, _CMP_EQ_OQ);
        if (tie) k |= tie & _mm512_cmple_epi32_mask(_mm512_add_epi32(_mm512_set1_epi32(i), lane), last);
        k &= _mm512_cmp_ps_mask(ve, mp, _CMP_GE_OQ);
        const __m512 v = _mm512_maskz_mov_ps(k, ve);
        a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
    s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#endif
    for (; i < hi; i++) s += kept(x[i], e[i], i, cut, min_p) ? (double)e[i] : 0.0;
    return s;
}

/* The draw: block sums of the kept masses, then a running sum inside the block u * total falls in. */
static int64_t draw(const Rows *w, int n, Cut cut, float min_p, double u) {
    const float *x = w->x, *e = w->e;
    const int nb = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int b = 0; b < nb; b++) {
        const int lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        w->blocks[b] = kept_mass(x, e, lo, hi, cut, min_p);
        total += w->blocks[b];
    }
    const double target = u * total;
    double run = 0.0;
    for (int b = 0; b < nb; b++) {
        if (w->blocks[b] > 0.0 && run + w->blocks[b] > target) {
            const int lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
            int64_t last = -1;
            for (int i = lo; i < hi; i++) {
                if (e[i] == 0.0f || !kept(x[i], e[i], i, cut, min_p)) continue;
                run += e[i];
                last = i;
                if (run > target) return i;
            }
            return last; /* the block's sum and the running sum rounded apart */
        }
        run += w->blocks[b];
    }
    for (int i = n - 1; i >= 0; i--) /* u * total rounded up to the total */
        if (e[i] > 0.0f && kept(x[i], e[i], i, cut, min_p)) return i;
    return -1;
}

/* The row's scaled logits and exponentials (w->x, w->e) and its top-k / top-p cut; -1 where the
 * row holds a NaN or no finite logit. */
static int row_cut(const float *l, int n, float t, int top_k, float top_p, const Rows *w, Cut *cut) {
    const float lmax = row_max(l, n);
    if (isnan(lmax) || !isfinite(lmax / t)) return -1;
    const float m = lmax / t; /* division by t > 0 keeps the order: the largest x */
    exp_row(l, t, m, w->x, w->e, n);
    *cut = (Cut){-INFINITY, n};
    const int use_k = top_k > 0 && top_k < n, use_p = top_p < 1.0f;
    if (use_k || use_p) {
        histogram(w, m, n, use_p);
        double total = 0.0;
        for (int b = 0; b < BUCKETS; b++) total += w->mass[b];
        int kb = BUCKETS - 1;
        if (use_k && top_k_cut(w, n, w->cnt, w->mass, top_k, cut, &total, &kb)) return -1;
        if (use_p && top_p_cut(w, n, w->cnt, w->mass, top_p, total, kb, cut)) return -1;
    }
    return 0;
}

static Rows rows_alloc(int V) {
    return (Rows){malloc(sizeof(float) * (size_t)V), malloc(sizeof(float) * (size_t)V),
                  malloc(sizeof(int32_t) * (size_t)V), malloc(sizeof(double) * (size_t)((V + BLOCK - 1) / BLOCK)),
                  malloc(sizeof(int) * 4 * BUCKETS), malloc(sizeof(int) * BUCKETS),
                  malloc(sizeof(double) * 4 * BUCKETS), malloc(sizeof(double) * BUCKETS)};
}

static int rows_ok(const Rows *w) {
    return w->x && w->e && w->bucket && w->blocks && w->cnt4 && w->cnt && w->mass4 && w->mass;
}

static void rows_free(Rows *w) {
    free(w->x);
    free(w->e);
    free(w->bucket);
    free(w->blocks);
    free(w->cnt4);
    free(w->cnt);
    free(w->mass4);
    free(w->mass);
}

/* probs[i] = the kept tokens' e_i over their sum, 0 elsewhere (softmax of the filtered logits). */
static void write_probs(const Rows *w, int n, Cut cut, float min_p, float *probs) {
    const float *x = w->x, *e = w->e;
    const float total = (float)kept_mass(x, e, 0, n, cut, min_p);
#pragma omp simd
    for (int i = 0; i < n; i++) probs[i] = kept(x[i], e[i], i, cut, min_p) ? e[i] / total : 0.0f;
}

/* Each row's cut, then its draw (probs NULL: out[r] the token or -1) or its distribution
 * (out[r] 1 where the row failed, its probs row unwritten). */
static void each_row(const float *logits, int64_t stride, const int64_t *rows, int M, int V, const float *temperature,
                     const int *top_k, const float *top_p, const float *min_p, const double *u, int64_t *out,
                     float *probs, int threads) {
#pragma omp parallel num_threads(threads) if (M > 1)
    {
        Rows w = rows_alloc(V);
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < M; r++) {
            Cut cut;
            const int ok =
                rows_ok(&w) && !row_cut(logits + rows[r] * stride, V, temperature[r], top_k[r], top_p[r], &w, &cut);
            if (probs) {
                out[r] = !ok;
                if (ok) write_probs(&w, V, cut, min_p[r], probs + (int64_t)r * V);
            } else {
                out[r] = ok ? draw(&w, V, cut, min_p[r], u[r]) : -1;
            }
        }
        rows_free(&w);
    }
}

/* logits [*, V] fp32 (row stride `stride`); for each of the M rows `rows[r]`: temperature[r] > 0,
 * top_k[r] (<= 0 or >= V: off), top_p[r] (>= 1: off), min_p[r] (0: off), u[r] in [0, 1) ->
 * out[r] the token, or -1 where the row holds a NaN or no finite logit. */
void sample_rows(const float *logits, int64_t stride, const int64_t *rows, int M, int V, const float *temperature,
                 const int *top_k, const float *top_p, const float *min_p, const double *u, int64_t *out,
                 int threads) {
    each_row(logits, stride, rows, M, V, temperature, top_k, top_p, min_p, u, out, NULL, threads);
}

/* The same rows' distributions: probs [M, V] (row-major), softmax of the filtered logits;
 * failed[r] = 1 where the row holds a NaN or no finite logit (its probs row unwritten), else 0. */
void filtered_probs(const float *logits, int64_t stride, const int64_t *rows, int M, int V, const float *temperature,
                    const int *top_k, const float *top_p, const float *min_p, float *probs, int64_t *failed,
                    int threads) {
    each_row(logits, stride, rows, M, V, temperature, top_k, top_p, min_p, NULL, failed, probs, threads);
}
