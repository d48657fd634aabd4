/* The greedy token of an fp32 LM head, exactly, without computing every logit.
 *
 * Why: at 262,144 x 640 Gemma's head is 671 MB of fp32 and 0.34 GFLOP per row: over half of a
 * batch-1 decode step's bytes and of a batched step's FLOPs, for a row that only needs its argmax.
 * An int8 copy of the head (per-row scale, 168 MB) against the row quantized to int16 gives every
 * logit to within a bound that is rigorous, not statistical; only the few tokens whose upper bound
 * reaches the best lower bound (of 262,144: a median of 14, at most 320, over 236 WikiText rows)
 * get their fp32 logit, the same FMA chain over k = 0 .. K-1 as panel_gemm.c computes, so the token is
 * bitwise the one argmax over the full fp32 logits picks (first index among equal maxima).
 * screen_top_k does the same for a row sampled under top-k, with T the k-th largest lower bound
 * (below, "top-k rows").
 *
 * The bound, for row h and token v with w = w_v, a = max|w|, s = a / 127, q = round(w / s),
 * e = max|w - s q|, hq = round(h / sh) (sh = max|h| / QH), r = max|h - sh hq|, dot = q . hq (exact):
 *   w . h  = s sh dot + s q . (h - sh hq) + (w - s q) . h, so |w . h - s sh dot| <= s |q|_1 r + e |h|_1;
 *   the fp32 chain F_v differs from w . h by at most gamma_K a |h|_1 (gamma_K = K u / (1 - K u)).
 * Bounds are computed in double with a relative slack far above double rounding. T = the largest
 * lower bound; a token whose upper bound is below T has F_v < T <= F of that token, so it is not the
 * argmax. QH keeps |dot| < 2^31: 127 * QH * Kp <= 2^31 - 1.
 *
 * Layout of the int8 copy: panels of 16 tokens, [ceil(V / 16), Kp / 2, 16, 2] (Kp = K rounded up
 * to even, zero-padded): for each pair of k, 16 tokens x 2 values, so vpmovsxbw + vpmaddwd against
 * a broadcast pair of the row's int16 values gives 8 tokens' partial dots per instruction.
 * AVX2, with each vpmaddwd + vpaddd fused into one vpdpwssd where the CPU has VNNI (0.81-0.87x the
 * screen's time on a Zen 4); with AVX-512 (BW) a chunk's 16 tokens fill one
 * 512-bit vector (0.56-0.60x the 256-bit VNNI screen's time on a Zen 5, whose units are 512 bits
 * wide); screen_available() is 0 without AVX2 and the caller computes the full logits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#define PT 16 /* tokens per panel */
#define SLACK (1.0 + 1e-9)
#define ABS_SLACK 1e-20 /* covers subnormal products (< K * 2^-126 * max|.|) */
#define PREFETCH_BYTES 4096
/* acc + the pairwise int16 products of h and w, in int32. With VNNI one vpdpwssd does what
 * vpmaddwd + vpaddd do, with the same wrap-around int32 sum (the products' pair sums never
 * saturate: |2 * 127 * QH| < 2^31), so the dots are bitwise the same. */
#if defined(__AVX512BW__)
/* AVX-512: a panel's pair-chunk (16 tokens x 2 values) widens into one 512-bit vector, so one
 * multiply-add per row covers all 16 tokens; each token's lane sums the same pair products in the
 * same order as the AVX2 path's, so the dots are bitwise the same. */
#define MR 12 /* rows per tile: 12 accumulators + the widened chunk + a broadcast of 32 registers */
#if defined(__AVX512VNNI__)
#define MADD_ACC(acc, h, w) _mm512_dpwssd_epi32((acc), (h), (w))
#else
#define MADD_ACC(acc, h, w) _mm512_add_epi32((acc), _mm512_madd_epi16((h), (w)))
#endif
#else
#define MR 6 /* rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast of 16 registers */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MADD_ACC(acc, h, w) _mm256_dpwssd_epi32((acc), (h), (w))
#elif defined(__AVXVNNI__)
#define MADD_ACC(acc, h, w) _mm256_dpwssd_avx_epi32((acc), (h), (w))
#else
#define MADD_ACC(acc, h, w) _mm256_add_epi32((acc), _mm256_madd_epi16((h), (w)))
#endif
#endif

int screen_available(void) { return 1; }

/* The head [V, K] read from its panel_gemm.c copy wp [ceil(V / pw), K, pw] -> q (layout above),
 * per token: scale s, c1 = e + gamma_K a, c2 = s |q|_1. (The packed copy: a tied embedding is often
 * stored transposed, and a contiguous copy would cost 671 MB and a second at start.) */
int screen_pack(const float *wp, int pw, int8_t *q, double *scale, double *c1, double *c2, int V, int K,
                int threads) {
    const int Kp = K + (K & 1), P = (V + PT - 1) / PT;
    const double u = ldexp(1.0, -24), gamma = K * u / (1.0 - K * u);
    int bad = 0; /* a non-finite weight: the screen's bounds would not hold, the caller keeps none */
    memset(q, 0, (size_t)P * Kp * PT);
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : bad)
    for (int v = 0; v < V; v++) {
        const float *col = wp + (size_t)(v / pw) * K * pw + v % pw; /* w[v, k] = col[k * pw] */
        double a = 0.0;
        for (int k = 0; k < K; k++) {
            bad |= !isfinite(col[(size_t)k * pw]);
            a = fmax(a, fabs((double)col[(size_t)k * pw]));
        }
        const double s = a / 127.0;
        double e = 0.0, l1 = 0.0;
        int8_t *dst = q + (size_t)(v / PT) * Kp * PT + (size_t)(v % PT) * 2;
        for (int k = 0; k < K; k++) {
            const float x = col[(size_t)k * pw];
            const double qv = s > 0.0 ? nearbyint(x / s) : 0.0; /* |qv| <= 127 */
            e = fmax(e, fabs((double)x - s * qv));
            l1 += fabs(qv);
            dst[(size_t)(k >> 1) * 2 * PT + (k & 1)] = (int8_t)qv;
        }
        scale[v] = s;
        c1[v] = e * SLACK + gamma * a;
        c2[v] = s * l1;
    }
    return bad;
}

/* 16 tokens' dots for rows [0, mr) of hq [*, Kp] against one panel -> dots [mr][16]. first: the
 * panel's first row tile, which streams it from memory (a software prefetch ahead: ~10% at one row). */
#if defined(__AVX512BW__)
static inline __attribute__((always_inline)) void tile(const int16_t *hq, int Kp, const int8_t *panel,
                                                      int32_t dots[MR][PT], const int mr, const int first) {
    __m512i acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_si512();
    for (int kk = 0; kk < Kp / 2; kk++) {
        const int8_t *p = panel + (size_t)kk * 2 * PT;
        if (first && (kk & 1) == 0) __builtin_prefetch(p + PREFETCH_BYTES);
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, hq + (size_t)i * Kp + 2 * kk, sizeof pair);
            acc[i] = MADD_ACC(acc[i], _mm512_set1_epi32(pair), w);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_si512((void *)dots[i], acc[i]);
}
#else
static inline __attribute__((always_inline)) void tile(const int16_t *hq, int Kp, const int8_t *panel,
                                                      int32_t dots[MR][PT], const int mr, const int first) {
    __m256i a0[MR], a1[MR];
    for (int i = 0; i < mr; i++) a0[i] = a1[i] = _mm256_setzero_si256();
    for (int kk = 0; kk < Kp / 2; kk++) {
        const int8_t *p = panel + (size_t)kk * 2 * PT;
        if (first && (kk & 1) == 0) __builtin_prefetch(p + PREFETCH_BYTES);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, hq + (size_t)i * Kp + 2 * kk, sizeof pair);
            const __m256i hb = _mm256_set1_epi32(pair);
            a0[i] = MADD_ACC(a0[i], hb, w0);
            a1[i] = MADD_ACC(a1[i], hb, w1);
        }
    }
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_si256((__m256i *)dots[i], a0[i]);
        _mm256_storeu_si256((__m256i *)(dots[i] + 8), a1[i]);
    }
}

#endif

typedef struct {
    int32_t v;
    double up;
} cand;

/* The fp32 logit panel_gemm.c computes for token v, read from its packed copy wp [ceil(V / pw), K,
 * pw]: one FMA chain from 0 over k = 0 .. K-1. */
static float exact_logit(const float *h, const float *wp, int pw, int v, int K) {
    const float *col = wp + (size_t)(v / pw) * K * pw + v % pw;
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc = fmaf(h[k], col[(size_t)k * pw], acc);
    return acc;
}

/* exact_logit for w <= 4 (row, token) pairs at once: four independent chains, each the same
 * arithmetic as exact_logit's, so that their strided loads overlap (1.2x at a few hundred). */
static void exact_logits(const float *x, const float *wp, int pw, int K, const int32_t *rows, const cand *c, int w,
                         float *f) {
    const float *h[4], *col[4];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < 4; j++) {
        const int src = j < w ? j : 0;
        h[j] = x + (size_t)rows[src] * K;
        col[j] = wp + (size_t)(c[src].v / pw) * K * pw + c[src].v % pw;
    }
    for (int k = 0; k < K; k++)
        for (int j = 0; j < 4; j++) acc[j] = fmaf(h[j][k], col[j][(size_t)k * pw], acc[j]);
    for (int j = 0; j < w; j++) f[j] = acc[j];
}

static inline void push(cand *mine, int *cnt, int cap, int v, double up) {
    if (*cnt < cap) mine[*cnt] = (cand){v, up};
    ++*cnt;
}

/* Bit c of the result: token v0 + c may be chosen (bit v % 32 of word v / 32 of the row's allowed
 * mask, xgrammar's layout; no mask: every token). v0 is a multiple of PT = 16, so a panel's bits
 * lie in one word. */
static inline unsigned allowed_bits(const int32_t *allowed, int v0) {
    return allowed ? ((uint32_t)allowed[v0 >> 5] >> (v0 & 31)) & 0xFFFFu : 0xFFFFu;
}

/* The half-width of token v's interval around est = s_v sh dot (c1, c2: its terms from
 * screen_pack; hl1, r: the row's): the bound above, with the slacks. The vector branches of
 * bounds() compute the same expression lane by lane. */
static inline double bound_width(double est, double c1, double c2, double hl1, double r) {
    return (hl1 * c1 + r * c2 + fabs(est) * 1e-12) * SLACK + ABS_SLACK;
}

/* One row's 16 dots of a panel -> bounds: raise the row's best lower bound T, keep the tokens whose
 * upper bound reaches it (tokens v0 .. v0 + ncols - 1; stats of those tokens). Tokens the row's
 * mask forbids neither raise T nor are kept: the argmax is then that of the masked logits. */
static inline void bounds(const int32_t *dots, const double *scale, const double *c1, const double *c2, int ncols,
                          double sh, double hl1, double r, double *T, int v0, const int32_t *allowed, cand *mine,
                          int *cnt, int cap) {
    const unsigned bits = allowed_bits(allowed, v0);
    if (!bits) return;
#if defined(__AVX512F__)
    if (ncols == PT) { /* 2 x 8 doubles: the same arithmetic per token as the AVX2 branch below */
        __m512d up[2], lo_max = _mm512_set1_pd(-INFINITY);
        const __m512d vsh = _mm512_set1_pd(sh), vl1 = _mm512_set1_pd(hl1), vr = _mm512_set1_pd(r);
        const __m512d rel = _mm512_set1_pd(1e-12), slack = _mm512_set1_pd(SLACK), abs_slack = _mm512_set1_pd(ABS_SLACK);
        for (int j = 0; j < 2; j++) {
            const __m512d d = _mm512_cvtepi32_pd(_mm256_loadu_si256((const __m256i *)(dots + 8 * j)));
            const __m512d est = _mm512_mul_pd(_mm512_mul_pd(_mm512_loadu_pd(scale + 8 * j), vsh), d);
            __m512d width = _mm512_add_pd(_mm512_mul_pd(vl1, _mm512_loadu_pd(c1 + 8 * j)),
                                          _mm512_mul_pd(vr, _mm512_loadu_pd(c2 + 8 * j)));
            width = _mm512_add_pd(width, _mm512_mul_pd(_mm512_abs_pd(est), rel));
            width = _mm512_add_pd(_mm512_mul_pd(width, slack), abs_slack);
            up[j] = _mm512_add_pd(est, width);
            lo_max = _mm512_mask_max_pd(lo_max, (__mmask8)(bits >> (8 * j)), lo_max, _mm512_sub_pd(est, width));
        }
        const double l = _mm512_reduce_max_pd(lo_max);
        if (l > *T) *T = l;
        const __m512d t = _mm512_set1_pd(*T);
        for (int j = 0; j < 2; j++) {
            unsigned mask = _mm512_cmp_pd_mask(up[j], t, _CMP_GE_OQ) & (bits >> (8 * j)) & 0xFFu;
            if (!mask) continue;
            double u[8];
            _mm512_storeu_pd(u, up[j]);
            for (; mask; mask &= mask - 1) {
                const int c = __builtin_ctz(mask);
                push(mine, cnt, cap, v0 + 8 * j + c, u[c]);
            }
        }
        return;
    }
#else
    if (ncols == PT) { /* 4 x 4 doubles */
        __m256d up[4], lo_max = _mm256_set1_pd(-INFINITY);
        const __m256d vsh = _mm256_set1_pd(sh), vl1 = _mm256_set1_pd(hl1), vr = _mm256_set1_pd(r);
        const __m256d rel = _mm256_set1_pd(1e-12), slack = _mm256_set1_pd(SLACK), abs_slack = _mm256_set1_pd(ABS_SLACK);
        const __m256d sign = _mm256_set1_pd(-0.0), none = _mm256_set1_pd(-INFINITY);
        const __m256i lane_bit = _mm256_setr_epi64x(1, 2, 4, 8);
        for (int j = 0; j < 4; j++) {
            const __m256d d = _mm256_cvtepi32_pd(_mm_loadu_si128((const __m128i *)(dots + 4 * j)));
            const __m256d est = _mm256_mul_pd(_mm256_mul_pd(_mm256_loadu_pd(scale + 4 * j), vsh), d);
            __m256d width = _mm256_add_pd(_mm256_mul_pd(vl1, _mm256_loadu_pd(c1 + 4 * j)),
                                          _mm256_mul_pd(vr, _mm256_loadu_pd(c2 + 4 * j)));
            width = _mm256_add_pd(width, _mm256_mul_pd(_mm256_andnot_pd(sign, est), rel));
            width = _mm256_add_pd(_mm256_mul_pd(width, slack), abs_slack);
            up[j] = _mm256_add_pd(est, width);
            const __m256i lanes = _mm256_and_si256(_mm256_set1_epi64x((bits >> (4 * j)) & 0xF), lane_bit);
            const __m256d keep = _mm256_castsi256_pd(_mm256_cmpeq_epi64(lanes, lane_bit));
            lo_max = _mm256_max_pd(lo_max, _mm256_blendv_pd(none, _mm256_sub_pd(est, width), keep));
        }
        double l[4];
        _mm256_storeu_pd(l, lo_max);
        for (int j = 0; j < 4; j++)
            if (l[j] > *T) *T = l[j];
        const __m256d t = _mm256_set1_pd(*T);
        for (int j = 0; j < 4; j++) {
            int mask = _mm256_movemask_pd(_mm256_cmp_pd(up[j], t, _CMP_GE_OQ)) & (int)((bits >> (4 * j)) & 0xF);
            if (!mask) continue;
            double u[4];
            _mm256_storeu_pd(u, up[j]);
            for (; mask; mask &= mask - 1) {
                const int c = __builtin_ctz(mask);
                push(mine, cnt, cap, v0 + 4 * j + c, u[c]);
            }
        }
        return;
    }
#endif
    for (int c = 0; c < ncols; c++) { /* the last, partial panel */
        if (!((bits >> c) & 1)) continue;
        const double est = scale[c] * sh * (double)dots[c];
        const double width = bound_width(est, c1[c], c2[c], hl1, r);
        if (est - width > *T) *T = est - width;
        if (est + width >= *T) push(mine, cnt, cap, v0 + c, est + width);
    }
}

/* Each row of x [M, K] to int16 codes hq [M, Kp] with its scale sh, |h|_1 and largest rounding error
 * r (both with the slack); skip: an all-zero or non-finite row, left to the full path. */
static void quantize_rows(const float *x, int M, int K, int Kp, int QH, int16_t *hq, double *sh, double *hl1,
                          double *r, int *skip) {
    for (int i = 0; i < M; i++) {
        const float *h = x + (size_t)i * K;
        double a = 0.0, l1 = 0.0;
        int finite = 1;
        for (int k = 0; k < K; k++) {
            finite &= isfinite(h[k]) != 0;
            a = fmax(a, fabs((double)h[k]));
            l1 += fabs((double)h[k]);
        }
        if (!finite || a == 0.0) { /* all-zero: every logit ties; leave it to the full path */
            skip[i] = 1, sh[i] = hl1[i] = r[i] = 0.0;
            continue;
        }
        const double s = a / QH;
        double err = 0.0;
        for (int k = 0; k < K; k++) {
            const double hv = nearbyint(h[k] / s);
            err = fmax(err, fabs((double)h[k] - s * hv));
            hq[(size_t)i * Kp + k] = (int16_t)hv;
        }
        sh[i] = s, hl1[i] = l1 * SLACK, r[i] = err * SLACK;
    }
}

/* tile() for a tile of mr <= MR rows, mr a compile-time constant in each branch. */
static inline __attribute__((always_inline)) void tile_rows(const int16_t *hq, int Kp, const int8_t *panel,
                                                           int32_t dots[MR][PT], int mr, int first) {
    switch (mr) {
    case 1: tile(hq, Kp, panel, dots, 1, first); break;
    case 2: tile(hq, Kp, panel, dots, 2, first); break;
    case 3: tile(hq, Kp, panel, dots, 3, first); break;
    case 4: tile(hq, Kp, panel, dots, 4, first); break;
    case 5: tile(hq, Kp, panel, dots, 5, first); break;
#if MR > 6
    case 6: tile(hq, Kp, panel, dots, 6, first); break;
    case 7: tile(hq, Kp, panel, dots, 7, first); break;
    case 8: tile(hq, Kp, panel, dots, 8, first); break;
    case 9: tile(hq, Kp, panel, dots, 9, first); break;
    case 10: tile(hq, Kp, panel, dots, 10, first); break;
    case 11: tile(hq, Kp, panel, dots, 11, first); break;
#endif
    default: tile(hq, Kp, panel, dots, MR, first); break;
    }
}

/* Thread t of nt's share of the head's panels against every row of hq: each panel's dots for
 * each row not skipped go to each(ctx, t, row, dots, panel, ncols). Inlined with each, a static
 * function, so the call is direct. */
typedef void (*panel_fn)(void *ctx, int t, int row, const int32_t *dots, int p, int ncols);
static inline __attribute__((always_inline)) void scan(const int16_t *hq, int Kp, const int *skip, int M,
                                                      const int8_t *q, int V, int t, int nt, panel_fn each,
                                                      void *ctx) {
    const int P = (V + PT - 1) / PT;
    const int p0 = (int)((long)P * t / nt), p1 = (int)((long)P * (t + 1) / nt);
    int32_t dots[MR][PT];
    for (int p = p0; p < p1; p++) {
        const int8_t *panel = q + (size_t)p * Kp * PT;
        const int ncols = V - p * PT < PT ? V - p * PT : PT;
        for (int m = 0; m < M; m += MR) {
            const int mr = M - m < MR ? M - m : MR;
            tile_rows(hq + (size_t)m * Kp, Kp, panel, dots, mr, m == 0);
            for (int i = 0; i < mr; i++)
                if (!skip[m + i]) each(ctx, t, m + i, dots[i], p, ncols);
        }
    }
}

typedef struct {
    const double *scale, *c1, *c2, *sh, *hl1, *r;
    const int32_t *allowed;
    int W, M, cap;
    double *best_lo; /* [threads, M] */
    int *count;      /* [threads, M] */
    cand *buf;       /* [threads, M, cap] */
} ArgmaxScan;

static void argmax_panel(void *ctx, int t, int row, const int32_t *dots, int p, int ncols) {
    const ArgmaxScan *a = ctx;
    const size_t slot = (size_t)t * a->M + row;
    bounds(dots, a->scale + p * PT, a->c1 + p * PT, a->c2 + p * PT, ncols, a->sh[row], a->hl1[row], a->r[row],
           &a->best_lo[slot], p * PT, a->allowed ? a->allowed + (size_t)row * a->W : NULL, a->buf + slot * a->cap,
           &a->count[slot], a->cap);
}

/* x [M, K] fp32 rows, wp the fp32 head packed by panel_gemm.c's pack_panels (pw columns a panel),
 * q/scale/c1/c2 from screen_pack -> tokens [M]: each row's argmax; -1 for a row the screen did not
 * settle (more than cap candidates in one thread, a zero or non-finite row, no allowed token) and
 * the caller computes in full. Returns how many rows those are. allowed: NULL, or [M, W] int32
 * words of allowed tokens (a grammar's mask): each row's argmax over those tokens alone. */
int screen_argmax(const float *x, const float *wp, int pw, const int8_t *q, const double *scale, const double *c1,
                  const double *c2, const int32_t *allowed, int W, int64_t *tokens, int M, int V, int K, int cap,
                  int threads) {
    const int Kp = K + (K & 1);
    const int QH = (int)fmin(16383.0, floor(2147483647.0 / (127.0 * Kp)));
    int16_t *hq = calloc((size_t)M * Kp, sizeof *hq);
    double *sh = malloc(sizeof(double) * (size_t)M * 3), *hl1 = sh + M, *r = sh + 2 * M;
    int *skip = calloc((size_t)M, sizeof *skip);
    if (threads < 1) threads = 1;
    cand *buf = malloc(sizeof(cand) * (size_t)threads * M * cap);
    int *count = calloc((size_t)threads * M, sizeof *count);
    double *best_lo = malloc(sizeof(double) * (size_t)threads * M);
    if (!hq || !sh || !skip || !buf || !count || !best_lo) {
        free(hq), free(sh), free(skip), free(buf), free(count), free(best_lo);
        for (int i = 0; i < M; i++) tokens[i] = -1;
        return M;
    }
    quantize_rows(x, M, K, Kp, QH, hq, sh, hl1, r, skip);
    /* Set here, not in the threads: the runtime may start fewer than asked, and the merge below
     * reads every slot. */
    for (size_t j = 0; j < (size_t)threads * M; j++) best_lo[j] = -INFINITY;
    ArgmaxScan ctx = {scale, c1, c2, sh, hl1, r, allowed, W, M, cap, best_lo, count, buf};
#pragma omp parallel num_threads(threads)
    scan(hq, Kp, skip, M, q, V, omp_get_thread_num(), omp_get_num_threads(), argmax_panel, &ctx);
    int unsettled = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : unsettled)
    for (int i = 0; i < M; i++) {
        if (skip[i]) {
            tokens[i] = -1, unsettled++;
            continue;
        }
        double T = -INFINITY;
        int over = 0;
        for (int t = 0; t < threads; t++) {
            T = fmax(T, best_lo[(size_t)t * M + i]);
            over |= count[(size_t)t * M + i] > cap;
        }
        if (over) {
            tokens[i] = -1, unsettled++;
            continue;
        }
        const float *h = x + (size_t)i * K;
        float best = -INFINITY;
        int64_t arg = -1;
        int finite = 1; /* an inf or NaN logit: the full path's rules (NaN is the maximum) decide */
        for (int t = 0; t < threads; t++) { /* threads hold increasing token ranges, each in order */
            const cand *c = buf + ((size_t)t * M + i) * cap;
            for (int j = 0; j < count[(size_t)t * M + i]; j++) {
                if (c[j].up < T) continue;
                const float f = exact_logit(h, wp, pw, c[j].v, K);
                finite &= isfinite(f) != 0;
                if (arg < 0 || f > best) best = f, arg = c[j].v;
            }
        }
        if (arg < 0 || !finite) arg = -1, unsettled++;
        tokens[i] = arg;
    }
    free(hq), free(sh), free(skip), free(buf), free(count), free(best_lo);
    return unsettled;
}
/* ---------------------------------------------------------------- top-k rows
 *
 * A row sampled under top-k (k small) needs only the logits of its k largest tokens: every
 * token below the k-th has probability 0. T = the k-th largest lower bound is at most the k-th
 * largest fp32 logit l_k, so a token whose upper bound is below T is not among the top k. The
 * sampler divides by the temperature before it cuts, and two logits a 2^-24 apart can round to
 * one quotient, so the kept tokens are those whose upper bound reaches below(T) = T - |T| 2^-20
 * (a token below that lies more than 2^-20 |l_k| under l_k: its quotient stays below l_k's).
 * below() is increasing and each thread's own k-th lower bound is at most T, so a thread that
 * drops what lies under below(its own) never drops a kept token. */

static inline double below(double T) { return T - fabs(T) * 0x1p-20 - 1e-30; }

typedef struct {
    double *heap; /* the k largest lower bounds so far, a min-heap */
    int n, k;
    double T; /* heap[0] once full, -inf before */
    cand *c;  /* candidates: upper bound >= below(T) when pushed */
    int cnt, cap, over;
} TopK;

static void heap_offer(TopK *s, double v) {
    if (s->n < s->k) { /* sift up */
        int i = s->n++;
        while (i > 0 && s->heap[(i - 1) / 2] > v) s->heap[i] = s->heap[(i - 1) / 2], i = (i - 1) / 2;
        s->heap[i] = v;
        if (s->n == s->k) s->T = s->heap[0];
        return;
    }
    if (v <= s->heap[0]) return;
    int i = 0; /* replace the minimum, sift down */
    for (;;) {
        int l = 2 * i + 1, m = i;
        double mv = v;
        if (l < s->n && s->heap[l] < mv) m = l, mv = s->heap[l];
        if (l + 1 < s->n && s->heap[l + 1] < mv) m = l + 1;
        if (m == i) break;
        s->heap[i] = s->heap[m], i = m;
    }
    s->heap[i] = v;
    s->T = s->heap[0];
}

static void push_top(TopK *s, int v, double up) {
    if (s->cnt == s->cap) { /* drop what the threshold has passed since */
        const double thr = below(s->T);
        int j = 0;
        for (int i = 0; i < s->cnt; i++)
            if (s->c[i].up >= thr) s->c[j++] = s->c[i];
        s->cnt = j;
        if (j == s->cap) {
            s->over = 1;
            return;
        }
    }
    s->c[s->cnt++] = (cand){v, up};
}

/* One row's 16 (or ncols) dots of a panel: raise the row's k largest lower bounds, keep the
 * tokens whose upper bound reaches below(T). The same bound as bounds() above. Tokens the row's
 * mask leaves out (its touched tokens, computed exactly apart) neither count nor are kept. */
static inline void bounds_top(const int32_t *dots, const double *scale, const double *c1, const double *c2,
                              int ncols, double sh, double hl1, double r, int v0, const int32_t *allowed, TopK *s) {
    const unsigned bits = allowed_bits(allowed, v0);
    if (!bits) return;
    double lo[PT], up[PT];
    double lmax = -INFINITY, umax = -INFINITY;
#pragma omp simd reduction(max : lmax, umax)
    for (int c = 0; c < PT; c++) {
        const int j = c < ncols ? c : 0; /* (a partial panel's missing tokens: any valid term, -inf below) */
        const int in = c < ncols && ((bits >> c) & 1u);
        const double est = scale[j] * sh * (double)dots[c];
        const double width = bound_width(est, c1[j], c2[j], hl1, r);
        lo[c] = in ? est - width : -INFINITY;
        up[c] = in ? est + width : -INFINITY;
        lmax = fmax(lmax, lo[c]);
        umax = fmax(umax, up[c]);
    }
    if (lmax > s->T)
        for (int c = 0; c < ncols; c++)
            if (lo[c] > s->T) heap_offer(s, lo[c]);
    const double thr = below(s->T);
    if (umax >= thr && !s->over)
        for (int c = 0; c < ncols; c++)
            if (up[c] >= thr) push_top(s, v0 + c, up[c]);
}

typedef struct {
    const double *scale, *c1, *c2, *sh, *hl1, *r;
    const int32_t *allowed; /* NULL, or [M, W] words: the tokens each row's bounds cover */
    int W, M;
    TopK *st; /* [threads, M] */
} TopKScan;

static void top_k_panel(void *ctx, int t, int row, const int32_t *dots, int p, int ncols) {
    const TopKScan *a = ctx;
    bounds_top(dots, a->scale + p * PT, a->c1 + p * PT, a->c2 + p * PT, ncols, a->sh[row], a->hl1[row], a->r[row],
               p * PT, a->allowed ? a->allowed + (size_t)row * a->W : NULL, &a->st[(size_t)t * a->M + row]);
}

static int desc_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Each row's mask of the tokens its bounds cover: all but its touched tokens (off [M + 1] into
 * ids, each below 32 W); NULL where that fails. */
static int32_t *untouched_masks(const int32_t *off, const int32_t *ids, int M, int W) {
    int32_t *mask = malloc(sizeof(int32_t) * (size_t)M * W);
    if (!mask) return NULL;
    memset(mask, 0xFF, sizeof(int32_t) * (size_t)M * W);
    for (int i = 0; i < M; i++)
        for (int j = off[i]; j < off[i + 1]; j++)
            mask[(size_t)i * W + (ids[j] >> 5)] &= (int32_t) ~(1u << (ids[j] & 31));
    return mask;
}

/* x [M, K] fp32 rows, the head and its screen as for screen_argmax, ks [M] each row's k (1 <= k
 * <= V) -> out [M, V]: for each row settled, the fp32 logits (panel_gemm.c's, bitwise) of every
 * token whose upper bound reaches below(T), -inf elsewhere: a superset of its top k that any
 * temperature, top-k, top-p and min-p cut the way they cut the full logits. touched_off [M + 1]
 * (NULL: none) and touched: each row's touched tokens (those its penalties or biases will
 * change, distinct, in [0, V)), which the bounds leave out and which get their fp32 logits
 * whatever they are: T is then the k-th largest lower bound of the others, at most the k-th
 * largest logit after any change to the touched ones, so the kept tokens still cover the top k
 * of the changed row. done[i] = 0 for a row left to the caller (more than cap candidates in a
 * thread, a zero or non-finite row or logit), its out row untouched. Returns how many rows
 * those are. */
int screen_top_k(const float *x, const float *wp, int pw, const int8_t *q, const double *scale, const double *c1,
                 const double *c2, const int32_t *ks, const int32_t *touched_off, const int32_t *touched, float *out,
                 int32_t *done, int M, int V, int K, int cap, int threads) {
    const int Kp = K + (K & 1);
    const int QH = (int)fmin(16383.0, floor(2147483647.0 / (127.0 * Kp)));
    if (threads < 1) threads = 1;
    int kmax = 1;
    for (int i = 0; i < M; i++) kmax = ks[i] > kmax ? ks[i] : kmax;
    const int W = (V + 31) / 32;
    int16_t *hq = calloc((size_t)M * Kp, sizeof *hq);
    double *sh = malloc(sizeof(double) * (size_t)M * 3), *hl1 = sh + M, *r = sh + 2 * M;
    int *skip = calloc((size_t)M, sizeof *skip);
    TopK *st = calloc((size_t)threads * M, sizeof *st);
    double *heaps = malloc(sizeof(double) * (size_t)threads * M * kmax);
    cand *buf = malloc(sizeof(cand) * (size_t)threads * M * cap);
    const int any_touched = touched_off && touched_off[M] > 0;
    int32_t *allowed = any_touched ? untouched_masks(touched_off, touched, M, W) : NULL;
    if (!hq || !sh || !skip || !st || !heaps || !buf || (any_touched && !allowed)) {
        free(hq), free(sh), free(skip), free(st), free(heaps), free(buf), free(allowed);
        for (int i = 0; i < M; i++) done[i] = 0;
        return M;
    }
    quantize_rows(x, M, K, Kp, QH, hq, sh, hl1, r, skip);
    for (int t = 0; t < threads; t++) /* every slot set here: the runtime may start fewer threads */
        for (int i = 0; i < M; i++)
            st[(size_t)t * M + i] = (TopK){heaps + ((size_t)t * M + i) * kmax, 0, ks[i], -INFINITY,
                                           buf + ((size_t)t * M + i) * cap, 0, cap, 0};
    TopKScan ctx = {scale, c1, c2, sh, hl1, r, allowed, W, M, st};
#pragma omp parallel num_threads(threads)
    scan(hq, Kp, skip, M, q, V, omp_get_thread_num(), omp_get_num_threads(), top_k_panel, &ctx);
    /* Each row's threshold from every thread's k largest lower bounds; a row to settle gets its
     * -inf fill. */
    double *thr = malloc(sizeof(double) * (size_t)M);
    int32_t *bad = calloc((size_t)M, sizeof *bad);
    int unsettled = 0;
#pragma omp parallel num_threads(threads)
    {
        double *all = malloc(sizeof(double) * (size_t)threads * kmax);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < M; i++) {
            int over = skip[i] || !all || !thr || !bad, n = 0;
            for (int t = 0; t < threads && !over; t++) {
                const TopK *s = &st[(size_t)t * M + i];
                over |= s->over;
                memcpy(all + n, s->heap, sizeof(double) * s->n);
                n += s->n;
            }
            done[i] = !over;
            if (over) continue;
            qsort(all, n, sizeof *all, desc_double);
            thr[i] = below(n >= ks[i] ? all[ks[i] - 1] : -INFINITY);
            float *row = out + (size_t)i * V;
            for (int v = 0; v < V; v++) row[v] = -INFINITY;
        }
        free(all);
    }
    /* The candidates of every row settled and its touched tokens, as one list the threads share
     * (a batch-1 row's few hundred would otherwise fall to one thread). */
    size_t total = 0;
    for (int i = 0; i < M; i++)
        if (done[i]) {
            for (int t = 0; t < threads; t++) total += st[(size_t)t * M + i].cnt;
            if (any_touched) total += (size_t)(touched_off[i + 1] - touched_off[i]);
        }
    cand *todo = thr && bad ? malloc(sizeof(cand) * (total ? total : 1)) : NULL;
    int32_t *todo_row = todo ? malloc(sizeof(int32_t) * (total ? total : 1)) : NULL;
    size_t nt = 0;
    for (int i = 0; i < M && todo_row; i++)
        if (done[i])
            for (int t = 0; t < threads; t++) {
                const TopK *s = &st[(size_t)t * M + i];
                for (int j = 0; j < s->cnt; j++)
                    if (s->c[j].up >= thr[i]) todo[nt] = s->c[j], todo_row[nt++] = i;
            }
    for (int i = 0; i < M && todo_row && any_touched; i++)
        if (done[i])
            for (int j = touched_off[i]; j < touched_off[i + 1]; j++)
                todo[nt] = (cand){touched[j], INFINITY}, todo_row[nt++] = i;
    if (!todo_row)
        for (int i = 0; i < M; i++) done[i] = 0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t j = 0; j < nt; j += 4) {
        const int w = nt - j < 4 ? (int)(nt - j) : 4;
        float f[4];
        exact_logits(x, wp, pw, K, todo_row + j, todo + j, w, f);
        for (int c = 0; c < w; c++) {
            out[(size_t)todo_row[j + c] * V + todo[j + c].v] = f[c];
            if (!isfinite(f[c])) {
#pragma omp atomic write
                bad[todo_row[j + c]] = 1;
            }
        }
    }
    for (int i = 0; i < M; i++) {
        if (done[i] && bad && bad[i]) done[i] = 0;
        unsettled += !done[i];
    }
    free(thr), free(bad), free(todo), free(todo_row), free(allowed);
    free(hq), free(sh), free(skip), free(st), free(heaps), free(buf);
    return unsettled;
}
#else
int screen_available(void) { return 0; }
int screen_pack(const float *wp, int pw, int8_t *q, double *scale, double *c1, double *c2, int V, int K,
                int threads) {
    (void)wp, (void)pw, (void)q, (void)scale, (void)c1, (void)c2, (void)V, (void)K, (void)threads;
    return 1;
}
int screen_argmax(const float *x, const float *wp, int pw, const int8_t *q, const double *scale, const double *c1,
                  const double *c2, const int32_t *allowed, int W, int64_t *tokens, int M, int V, int K, int cap,
                  int threads) {
    (void)x, (void)wp, (void)pw, (void)q, (void)scale, (void)c1, (void)c2, (void)allowed, (void)W, (void)V, (void)K,
        (void)cap, (void)threads;
    for (int i = 0; i < M; i++) tokens[i] = -1;
    return M;
}
int screen_top_k(const float *x, const float *wp, int pw, const int8_t *q, const double *scale, const double *c1,
                 const double *c2, const int32_t *ks, const int32_t *touched_off, const int32_t *touched, float *out,
                 int32_t *done, int M, int V, int K, int cap, int threads) {
    (void)x, (void)wp, (void)pw, (void)q, (void)scale, (void)c1, (void)c2, (void)ks, (void)touched_off, (void)touched,
        (void)out, (void)V, (void)K, (void)cap, (void)threads;
    for (int i = 0; i < M; i++) done[i] = 0;
    return M;
}
#endif
